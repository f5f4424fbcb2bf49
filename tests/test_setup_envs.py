"""scripts/setup_envs.sh marks an environment complete only when every install step worked.

A copy of the script and pyproject.toml runs in a temporary repository with a fake interpreter whose
venvs hold a scripted ``pip`` (it fails any install naming torch, as a dropped download would) and a
``python`` that always succeeds, so nothing is downloaded and the real checkout's links are untouched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/bin/bash
if [[ "$1" == "-m" && "$2" == "venv" ]]; then
  mkdir -p "$3/bin"
  cat > "$3/bin/pip" <<'EOF'
#!/bin/bash
echo "pip $*" >> "$(dirname "$0")/../pip-calls"
if [[ "$*" == *torch* ]]; then echo "simulated: connection reset while downloading torch" >&2; exit 1; fi
exit 0
EOF
  printf '#!/bin/bash\\nexit 0\\n' > "$3/bin/python"
  chmod +x "$3/bin/pip" "$3/bin/python"
  exit 0
fi
exec {real} "$@"
"""


def test_a_failed_install_step_stops_the_build_and_leaves_no_complete_environment(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup_envs.sh", repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    fake = tmp_path / "python-fake"
    fake.write_text(FAKE_PYTHON.replace("{real}", sys.executable))
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    env = {**os.environ, "LIGHTNING_ENV_CACHE": str(cache), "LIGHTNING_PYTHON": str(fake)}
    res = subprocess.run(["bash", str(repo / "scripts" / "setup_envs.sh"), "verl"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    output = res.stdout
    assert res.returncode == 1, output
    assert "[setup] verl environment failed" in output and "simulated: connection reset" in output
    (built,) = [p for p in cache.iterdir() if p.is_dir()]
    assert not (built / ".complete").exists()
    calls = (built / "pip-calls").read_text()
    assert "torch" in calls and "verl==" not in calls  # stopped at the failing step
    assert not (repo / ".venv-verl").exists()  # nothing linked into the checkout
