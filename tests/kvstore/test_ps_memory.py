"""Memory of a server: each key once, plus one merge buffer per key in flight (issue target: peak RSS <=
2.2 x the stored bytes + 200 MB)."""

from __future__ import annotations

import re

import pytest
from ps_cluster import Cluster


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_peak_rss_within_target(tmp_path):
    with Cluster(tmp_path, 2, 1) as c:
        c.start_roles()
        results = c.run_workers("big_rounds", "32", "4", "3", timeout=240)  # 4 keys of 32 MiB: 128 MiB stored
        assert all(r.returncode == 0 for r in results), c.report()
        assert c.wait_roles(60) == [0, 0], c.report()
        peak, stored = map(int, re.search(r"peak RSS (\d+) bytes for (\d+) bytes", c.output("server0")).groups())
        assert stored == 128 * 2**20
        assert peak <= 2.2 * stored + 200e6, f"server peak RSS {peak / 2**20:.0f} MiB for {stored / 2**20:.0f} MiB"
