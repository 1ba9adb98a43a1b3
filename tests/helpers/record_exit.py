"""``python record_exit.py DIR ARGS...``: run ``python ARGS...`` as a child and write its exit status to
``DIR/exit.$RANK`` (``Popen.returncode``: ``-N`` when signal N ended it), then end the same way.

For launchers that hide their workers' statuses: torchrun (torchelastic) signals each worker's process
group (``os.killpg``) on shutdown and reports only its own status. This wrapper is the worker torchrun
sees; the job runs in the same process group, so it gets the launcher's signal itself, with the
disposition it would have unwrapped (a Python handler set here is reset to the default in the child by
``exec``). The wrapper's own handler only keeps it alive until the job has ended.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

out_dir, args = Path(sys.argv[1]), sys.argv[2:]
caught = []
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: caught.append(signum))  # the job got it too: wait for the job
job = subprocess.Popen([sys.executable, *args])
while True:
    try:
        status = job.wait()
        break
    except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
        continue
(out_dir / f"exit.{os.environ.get('RANK', '0')}").write_text(f"{status}\n")
if status < 0:  # end as the job did: by the same signal, with the default disposition
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status)
