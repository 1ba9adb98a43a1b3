"""``mfuwatch analyze`` imports torch's FLOP formulas without Triton (about 75 MB less resident memory).

Run in a child process, since the test process may already hold triton or ``torch.utils.flop_counter``.
The formula checked is ``aten::mm``'s: ``2 * m * k * n`` FLOPs for an (m, k) @ (k, n) product.
"""

import json
import subprocess
import sys

CHILD = r"""
import json, sys
from mfuwatch.agent.analysis import opcost
opcost.import_formulas_without_triton()
table, fc = opcost._torch_formulas()
formula, _ = table["aten::mm"]
print(json.dumps({"triton": "triton" in sys.modules, "hidden_left": sys.modules.get("triton", 0) is None,
                  "flop_counter": fc is not None, "mm": formula([3, 5], [5, 7])}))
"""


def test_formulas_come_without_importing_triton():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"triton": False, "hidden_left": False, "flop_counter": True, "mm": 2 * 3 * 5 * 7}
