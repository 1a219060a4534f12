"""images.dockerfile: the supported subset, its errors (with line numbers) and cache keys."""

from __future__ import annotations

import random

import pytest

from images import dockerfile as df

GOOD = """
# a comment
FROM python
ARG VERSION=1.2
ENV A=1 B="two words"
RUN pip install \\
    thing==$VERSION
WORKDIR /srv
COPY --chown=nobody app.py data/ ./
ADD notes.txt /etc/notes.txt
USER nobody
EXPOSE 8000 9000/tcp
ENTRYPOINT ["python3"]
CMD ["app.py"]
# agentbox: ready http 8000 /health
# agentbox: ready-timeout 90
"""


def test_parses_the_supported_subset():
    r = df.parse(GOOD)
    assert r.base == "python"
    assert [s.kind for s in r.steps] == [df.StepKind.RUN, df.StepKind.COPY, df.StepKind.COPY]
    run, copy, add = r.steps
    assert run.line == 6 and run.command == "pip install thing==$VERSION"
    assert run.state.env == (("A", "1"), ("B", "two words")) and run.state.workdir == "/"
    assert copy.sources == ("app.py", "data/") and copy.dest == "/srv/" and copy.chown == "nobody"
    assert add.dest == "/etc/notes.txt" and add.state.workdir == "/srv"
    assert r.final.user == "nobody" and r.expose == (8000, 9000)
    assert r.start == ("python3", "app.py")
    assert r.ready == df.Ready("http", port=8000, path="/health", timeout=90.0)


def test_debian_bookworm_is_the_minimal_template_and_shell_forms_wrap_in_sh():
    r = df.parse("FROM debian:bookworm\nCMD python3 -m http.server\n# agentbox: ready tcp 8000")
    assert r.base == "minimal"
    assert r.start == ("/bin/sh", "-c", "python3 -m http.server")
    assert r.ready == df.Ready("tcp", port=8000)


@pytest.mark.parametrize(("text", "line", "needle"), [
    ("FROM python\nRUN true\nHEALTHCHECK CMD true\n", 3, "agentbox: ready"),
    ("FROM python\nVOLUME /x\n", 2, "VOLUME"),
    ("FROM python\n\nSTOPSIGNAL 9\n", 3, "STOPSIGNAL"),
    ("RUN true\n", 1, "before FROM"),
    ("FROM python\nFROM node\n", 2, "multi-stage"),
    ("FROM ubuntu:22.04\n", 1, "debian:bookworm"),
    ("FROM python\nCOPY http://x/y /y\n", 2, "URL"),
    ("FROM python\nCOPY ../secret /y\n", 2, "inside the context"),
    ("FROM python\nCOPY --from=build /a /b\n", 2, "--from"),
    ("FROM python\nEXPOSE 53/udp\n", 2, "TCP"),
    ("FROM python\nEXPOSE 70000\n", 2, "not a port"),
    ("FROM python\nCMD [\"a\", 1]\n", 2, "array of strings"),
    ("FROM python\nENV 1A=x\n", 2, "bad variable name"),
    ("FROM python\nUSER ro;ot\n", 2, "USER"),
    ("FROM python\n# agentbox: ready udp 1\nCMD x\n", 2, "http|tcp|cmd"),
    ("FROM python\n# agentbox: readyy http 1\n", 2, "unknown agentbox directive"),
    ("FROM python\nRUN a \\\n", 2, "continuation"),
])
def test_errors_name_the_line(text, line, needle):
    with pytest.raises(df.DockerfileError) as info:
        df.parse(text)
    assert info.value.line == line
    assert f"line {line}:" in str(info.value) and needle in str(info.value)


def test_ready_needs_a_start_command_and_from_is_required():
    with pytest.raises(df.DockerfileError, match="needs a CMD"):
        df.parse("FROM python\n# agentbox: ready tcp 80\n")
    with pytest.raises(df.DockerfileError, match="no FROM"):
        df.parse("# only a comment\n")


def test_a_shell_form_cmd_is_dropped_under_an_entrypoint_as_docker_does():
    assert df.parse("FROM python\nCMD echo hi\nENTRYPOINT [\"top\"]\n").start == ("top",)


def test_mangled_dockerfiles_parse_or_raise_dockerfile_error_only():
    rng = random.Random(11)
    alphabet = "FROMRUNCOPY \\\n#[]\"'=$:{}/-agentbox.0123456789"
    for _ in range(3000):
        text = list(GOOD)
        for _ in range(rng.randint(1, 8)):
            text.insert(rng.randrange(len(text) + 1), rng.choice(alphabet))
            if rng.random() < 0.5:
                del text[rng.randrange(len(text))]
        try:
            df.parse("".join(text))
        except df.DockerfileError:
            pass


# -- cache keys -------------------------------------------------------------------------------

def keys(text: str, digests: dict[int, str] | None = None, base: str = "/g/python") -> list[str]:
    r = df.parse(text)
    key, out = df.base_key(base), []
    for i, step in enumerate(r.steps):
        key = df.step_key(key, step, (digests or {}).get(i, ""))
        out.append(key)
    return out + [df.final_key(key, r, 512)]


BASE = "FROM python\nRUN one\nCOPY a /a\nRUN two\nCMD [\"srv\"]\n"


def test_the_same_dockerfile_gives_the_same_keys_and_whitespace_in_comments_does_not_matter():
    assert keys(BASE) == keys(BASE) == keys("# hi\n" + BASE + "\n\n")


def test_a_change_at_step_k_keeps_the_keys_before_it():
    changed = keys(BASE.replace("RUN two", "RUN three"))
    assert changed[:2] == keys(BASE)[:2] and changed[2:] != keys(BASE)[2:]


def test_copied_bytes_the_base_and_the_env_are_part_of_the_key():
    assert keys(BASE, {1: "d1"})[0] == keys(BASE, {1: "d2"})[0]
    assert keys(BASE, {1: "d1"})[1] != keys(BASE, {1: "d2"})[1]
    assert keys(BASE, base="/g/other")[0] != keys(BASE)[0]
    with_env = keys(BASE.replace("RUN two", "ENV X=1\nRUN two"))
    assert with_env[:2] == keys(BASE)[:2] and with_env[2] != keys(BASE)[2]


def test_only_the_final_key_changes_with_the_start_command():
    other = keys(BASE.replace("srv", "other"))
    assert other[:-1] == keys(BASE)[:-1] and other[-1] != keys(BASE)[-1]


def test_context_files_and_digest(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("x")
    (tmp_path / "a.py").write_text("a")
    files = df.context_files(tmp_path, ("a.py", "d"))
    assert [rel for rel, _ in files] == ["a.py", "x.txt"]
    before = df.context_digest(files)
    (tmp_path / "d" / "x.txt").write_text("changed")
    assert df.context_digest(files) != before
    with pytest.raises(df.DockerfileError, match="not found"):
        df.context_files(tmp_path, ("missing",))
    (tmp_path / "link").symlink_to("/etc/hostname")
    with pytest.raises(df.DockerfileError, match="outside the context"):
        df.context_files(tmp_path, ("link",))
