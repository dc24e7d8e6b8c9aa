"""Elastic: a host whose slot count goes down (issue 38, item 8), tried as a new user would:
3 ranks on this machine, the discovery script switches from ``localhost:3`` to
``localhost:2`` at step 4. The rank beyond the new slot count must leave at that commit and
2 ranks go on; the final parameters must equal a replay of 3 ranks up to the commit the job
reported, then 2 (the helpers of tests/parallel/test_elastic.py). Before the fix lccrun said
"the same 3 ranks continue" and 3 ranks ran on 2 slots."""
from __future__ import annotations

import re
import sys

import pytest

from tests.parallel.test_elastic import COMMIT, WORKER, _check_params, _replay
from tests.parallel.test_reliability import _finish, _lccrun, _lccrun_env, needs_lccrun


@needs_lccrun
@pytest.mark.timeout(480)
def test_a_host_whose_slots_go_down_loses_the_ranks_beyond_them(tmp_path):
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("localhost:3\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    out_pt = tmp_path / "params.pt"
    proc, _ = _lccrun(["-np", "3", "--min-np", "2", "--elastic-timeout", "120",
                       "--host-discovery-script", str(script), "--host-discovery-period",
                       "0.3", sys.executable, str(WORKER), str(out_pt), "-1", "0", "4",
                       "localhost:2"], {**_lccrun_env(), "LCC_TEST_HOSTS_FILE": str(hosts_file)})
    rc, out, err = _finish(proc, 400)
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert "lccrun: elastic: hosts changed (localhost 3->2 slots)" in err, err
    assert "lccrun: elastic: removed (host left) rank 2 (launch numbering); 2 ranks continue" \
        in err, err
    assert "the same 3 ranks continue" not in err, err
    assert "DONE size 2 resets 1" in out, out
    epoch, batch, size = map(int, re.search(r"RESET (\d+) (\d+) (\d+)", out).groups())
    assert size == 2 and batch % COMMIT == 0 and (epoch, batch) >= (0, 4), out
    _check_params(out_pt, _replay(3, epoch, batch, 2))
