"""jaxrl.hostmem (set by jaxrl-train): freed large blocks go back to the system (the main job's RSS, issue 14)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# In a thread (its own glibc arena, as Orbax's and XLA's are): a 30 MB block freed (glibc then raises its mmap
# threshold to 30 MB), 50 blocks of 8 MB, all freed but the last: prints the MB still resident.
_CHURN = """
import sys, threading
import numpy as np

if sys.argv[1] == "set":
  from jaxrl.hostmem import return_freed_memory

  assert return_freed_memory()

def rss_mb():
  return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

def churn():
  big = np.ones(30 << 17)
  del big
  blocks = [np.ones(1 << 20) for _ in range(50)]
  last = blocks[-1]
  del blocks
  held.append(last)

held = []
base = rss_mb()
thread = threading.Thread(target=churn)
thread.start()
thread.join()
print(rss_mb() - base)
"""


def _resident_after_churn(mode: str) -> float:
  out = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, cwd=REPO, check=True,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
  return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_go_back_to_the_system():
  assert _resident_after_churn("default") > 300  # glibc keeps the 49 freed blocks below the live one
  assert _resident_after_churn("set") < 50  # each was its own mapping, unmapped when freed
