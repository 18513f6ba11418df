"""Shared by the infra checks: the image's environment and `sluice check-config`.

A configuration shipped in infra/ is checked the way the container reads it: the file, with
the SLUICE_* variables of the image (ENV lines of infra/Dockerfile) and of the service or
container on top, in a clean environment so the caller's own SLUICE_* cannot leak in.
"""

import os
import shlex
import subprocess
from pathlib import Path

INFRA = Path(__file__).resolve().parent.parent


def image_env(dockerfile=INFRA / "Dockerfile"):
    """The variables the runtime stage of the Dockerfile sets (its last stage's ENV lines)."""
    env = {}
    lines = Path(dockerfile).read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        words = line.strip().split(None, 1)
        if not words:
            continue
        if words[0].upper() == "FROM":
            env = {}  # a new stage starts; only the last one is the image
        elif words[0].upper() == "ENV" and len(words) == 2:
            for pair in shlex.split(words[1]):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def check_config(binary, path, env):
    """Runs `sluice check-config path` with exactly `env` (plus PATH). Returns (ok, output)."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    clean.update({k: str(v) for k, v in env.items()})
    done = subprocess.run(
        [str(binary), "check-config", str(path)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode == 0, (done.stdout + done.stderr).strip()
