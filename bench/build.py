"""Template builds from a Dockerfile: cold cache vs warm cache vs a changed last step.

    python bench/build.py [-n ROUNDS]

One private daemon (its own data dir, so its own build cache). Each round builds a
Dockerfile made unique by a nonce in its first RUN (every step misses: cold), builds it
again unchanged (every step hits: warm), then with only the start command changed (the RUN
and COPY layers hit, the final golden step runs: "changed CMD"). The three kinds alternate
within each round; medians over rounds. Times are wall clock from the POST to the log's
`done` event, as a client sees them.
"""

from __future__ import annotations

import argparse
import secrets
import time

from _common import private_daemon, report

from tests.e2e.test_template_build import APP, build

DOCKERFILE = """FROM python
RUN echo {nonce} > /etc/bench-nonce && pip install tomli-w==1.0.0
COPY app.py msg.txt /srv/app/
ENV GREETING=bench
WORKDIR /srv/app
CMD ["python3", "app.py"{extra}]
# agentbox: ready http 8000 /health
"""


def timed(api, name: str, dockerfile: str) -> tuple[float, dict]:
    files = {"Dockerfile": dockerfile.encode(), "app.py": APP, "msg.txt": b"bench\n"}
    started = time.monotonic()
    result, _ = build(api, name, files)
    elapsed = (time.monotonic() - started) * 1000
    assert result["state"] == "ready", result
    return elapsed, result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", "--rounds", type=int, default=3)
    args = p.parse_args()
    cold, warm, changed = [], [], []
    with private_daemon() as daemon, daemon.client() as api:
        api.timeout = 1800
        for i in range(args.rounds):
            nonce = secrets.token_hex(8)
            df = DOCKERFILE.format(nonce=nonce, extra="")
            ms, r = timed(api, f"cold-{i}", df)
            cold.append(ms)
            assert r["cached_steps"] == 0, r
            ms, r = timed(api, f"warm-{i}", df)
            warm.append(ms)
            assert r["cached_steps"] == r["steps"], r
            ms, r = timed(api, f"cmd-{i}", DOCKERFILE.format(nonce=nonce, extra=', "-u"'))
            changed.append(ms)
            assert r["cached_steps"] == r["steps"] - 1, r
    report("build, cold cache (3 steps run)", cold)
    report("build, warm cache (all 3 steps cached)", warm)
    report("build, changed CMD (2 cached, final runs)", changed)


if __name__ == "__main__":
    main()
