"""What goes into each template: packages, default RAM, disk headroom, warm-up.

Every template shares the base (debootstrap minbase plus what the guest agent
needs) so the slow debootstrap step is done once and reused; templates add
their own packages on top with apt.
"""

from __future__ import annotations

from dataclasses import dataclass

# The guest agent's runtime (python3 + aiohttp), the tools init.py uses (ip),
# and what any sandbox user expects to find (ps, TLS roots).
BASE_PACKAGES = ("python3", "python3-aiohttp", "iproute2", "procps", "ca-certificates")


MINIMAL_TOOLS = ("git", "curl", "wget", "jq", "less", "file", "unzip", "zip", "xz-utils",
                 "bzip2", "vim-tiny", "openssh-client")


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    packages: tuple[str, ...]   # on top of BASE_PACKAGES
    mem_mib: int                # default guest RAM
    warmup: str                 # Python run in the guest before the golden snapshot
    headroom_mib: int = 1024    # free space left in the root file system
    # Modules the guest's execute zygote imports once, so each Python execute (a fork of
    # it) starts with them loaded; () = the stdlib modules the zygote needs itself.
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.replace("-", "").isalnum():
            raise ValueError(f"template name must be alphanumeric with dashes: {self.name!r}")
        if self.mem_mib < 128:
            raise ValueError(f"{self.name}: mem_mib must be >= 128, got {self.mem_mib}")
        for module in self.preload:
            if not all(part.isidentifier() for part in module.split(".")):
                raise ValueError(f"{self.name}: preload entry is not a module name: {module!r}")


SPECS: dict[str, TemplateSpec] = {spec.name: spec for spec in (
    TemplateSpec(
        name="python",
        packages=("python3-pip", "python3-venv"),
        mem_mib=512,
        warmup="import json, os, re, subprocess, sys, asyncio, pathlib, datetime\n",
        preload=("asyncio", "datetime", "json", "pathlib", "re", "subprocess"),
    ),
    TemplateSpec(
        name="minimal",
        # bash and coreutils are Essential; the command-line tools people reach for first.
        packages=MINIMAL_TOOLS,
        mem_mib=256,
        warmup="",
    ),
    TemplateSpec(
        name="node",
        packages=("nodejs", "npm"),
        mem_mib=512,
        # Page node's binary and core modules in, so the first `node` is quick.
        warmup=(
            "import subprocess\n"
            "subprocess.run(['node', '-e', 'require(\"http\")'], check=False)\n"
        ),
    ),
    TemplateSpec(
        name="python-datascience",
        # scikit-learn needs scipy, and Debian's python3-scipy hard-depends on pythran,
        # which drags in g++ and boost (~+700 MB): the price of scikit-learn from Debian.
        # (python3-munkres satisfies fonttools' "scipy | munkres" either way.)
        packages=("python3-pip", "python3-venv", "python3-numpy", "python3-pandas",
                  "python3-matplotlib", "python3-munkres", "python3-sklearn"),
        mem_mib=1024,
        warmup=(
            "import matplotlib\nmatplotlib.use('Agg')\n"
            "import numpy, pandas, matplotlib.pyplot, sklearn, sklearn.linear_model\n"
        ),
        headroom_mib=2048,
        preload=("asyncio", "datetime", "json", "pathlib", "re", "subprocess",
                 "numpy", "pandas", "matplotlib", "matplotlib.pyplot", "sklearn",
                 "sklearn.linear_model"),
    ),
)}

TEMPLATES: tuple[str, ...] = tuple(SPECS)

# Other names a create (or a Dockerfile's FROM) may use for a built-in template.
ALIASES: dict[str, str] = {
    "python3": "python", "py": "python",
    "datascience": "python-datascience", "python-data": "python-datascience",
    "data-science": "python-datascience",
    "nodejs": "node", "javascript": "node", "js": "node",
    "debian": "minimal", "bash": "minimal", "shell": "minimal",
}
