"""Elastic host changes (issue 38, item 8): a host whose slot count goes down keeps only that
many ranks, and lccrun's membership record is written whichever host rank 0 runs on."""
from __future__ import annotations

import json
import logging

from lightcc.common.elastic import growth, hosts as hosts_mod, recovery
from lightcc.runner import diagnosis


def test_ranks_beyond_a_hosts_new_slot_count_leave():
    three_to_two = hosts_mod.HostList(2, (("localhost", 2),), launcher="node0")
    # 3 ranks on lccrun's machine, its slots went from 3 to 2: the last one in rank order goes
    assert growth.stays(three_to_two, ["node0", "node0", "node0"]) == [True, True, False]
    two_hosts = hosts_mod.HostList(3, (("a", 1), ("b", 2)))
    assert growth.stays(two_hosts, ["a", "b", "a", "c", "b", "b"]) == \
        [True, True, False, False, True, False]
    assert growth.stays(hosts_mod.HostList(), ["x", "y"]) == [True, True]   # no list


def test_the_membership_record_comes_from_any_rank_with_the_status_dir(tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setenv(recovery.STATUS_DIR_ENV, str(tmp_path))
    change = {"size": 2, "lost": [], "removed": [2], "joined": [], "blacklisted": [],
              "failures": 0, "seconds": 0.5, "change": 3, "dropped_sets": []}
    with caplog.at_level(logging.WARNING, logger="lightcc"):
        recovery._report(change, log_it=False)        # not rank 0: no log line, a record
    assert not [r for r in caplog.records if "elastic" in r.getMessage()]
    record = json.loads((tmp_path / "elastic-3.json").read_text())
    assert record["removed"] == [2] and record["size"] == 2
    recovery._report(change, log_it=False)            # a second local rank: same file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elastic-3.json"]
    assert diagnosis.membership_lines(str(tmp_path), set()) == [
        "lccrun: elastic: removed (host left) rank 2 (launch numbering); 2 ranks continue, "
        "group re-formed in 0.50 s"]
