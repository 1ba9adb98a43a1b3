"""Child process of test_analyze_robust.py: run ``mfuwatch analyze`` on every case file under a memory cap.

argv: CASES_DIR RESULTS_JSON MEMORY_LIMIT_BYTES. For each ``*.case`` file, calls
``mfuwatch.agent.analysis.analyze.main`` in-process with stderr captured and records the exit
status, the first stderr line and whether a traceback escaped. Writes the results and
the peak RSS (MB) as JSON.
"""

import contextlib
import io
import json
import os
import resource
import sys
import traceback

cases, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from mfuwatch.agent.analysis.analyze import main  # noqa: E402

results = []
for name in sorted(os.listdir(cases)):
    path = os.path.join(cases, name)
    err, outbuf = io.StringIO(), io.StringIO()
    escaped = None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(outbuf):
            rc = main([path, "--json", "--peak-flops", "bf16=989e12", "--peak-flops", "fp32=67e12",
                       "--bandwidth", "4.8e12"])
    except SystemExit as exc:
        rc = exc.code
    except BaseException as exc:  # noqa: BLE001 - what the test looks for
        rc, escaped = -1, "".join(traceback.format_exception_only(type(exc), exc)).strip()
    text = outbuf.getvalue()
    results.append({"case": name, "rc": rc, "stderr": err.getvalue().strip().splitlines()[:1],
                    "traceback": escaped or ("Traceback" in err.getvalue() and err.getvalue()[-500:]) or None,
                    "nan": ("NaN" in text or "Infinity" in text)})
json.dump({"results": results, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
          open(out, "w"))
