"""Elastic: a host whose slot count goes down (issue 38, item 8), tried as a new user would:
3 ranks on this machine, the discovery script switches from ``localhost:3`` to
``localhost:2`` at step 4. The rank beyond the new slot count must leave at that commit and
2 ranks go on; the final parameters must equal a replay of 3 ranks up to the commit the job
reported, then 2 (the helpers of tests/parallel/test_elastic.py). Before the fix lccrun said
"the same 3 ranks continue" and 3 ranks ran on 2 slots."""
from __future__ import annotations

import re

import pytest

from tests.parallel.test_elastic import COMMIT, _check_params, _replay, run_discovery_job
from tests.parallel.test_reliability import needs_lccrun


@needs_lccrun
@pytest.mark.timeout(480)
def test_a_host_whose_slots_go_down_loses_the_ranks_beyond_them(tmp_path):
    out_pt = tmp_path / "params.pt"
    rc, out, err = run_discovery_job(tmp_path, "localhost:3", "localhost:2", out_pt,
                                     ["-np", "3", "--min-np", "2"])
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert "lccrun: elastic: hosts changed (localhost 3->2 slots)" in err, err
    assert "lccrun: elastic: removed (host left) rank 2 (launch numbering); 2 ranks continue" \
        in err, err
    assert "the same 3 ranks continue" not in err, err
    assert "DONE size 2 resets 1" in out, out
    epoch, batch, size = map(int, re.search(r"RESET (\d+) (\d+) (\d+)", out).groups())
    assert size == 2 and batch % COMMIT == 0 and (epoch, batch) >= (0, 4), out
    _check_params(out_pt, _replay(3, epoch, batch, 2))
