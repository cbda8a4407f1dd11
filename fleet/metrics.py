"""The fleet on ``GET /metrics``: a ``llamaswap_fleet_*`` family read from the fleet view at
scrape time (in memory; nothing when fleet mode is off). The existing metrics keep their
labels: each node's ``/metrics`` is that node's, and these series show the fleet as this
node sees it, so a scrape of any node adds up to the fleet:

* ``llamaswap_fleet_nodes{state}``: nodes up and down;
* ``llamaswap_fleet_node_up{node}``: 1 while a node's heartbeat is fresh;
* ``llamaswap_fleet_degraded``: 1 while this node cannot reach the fleet's Redis;
* ``llamaswap_fleet_running{node}``: requests being served on each node;
* ``llamaswap_fleet_model_loaded{node,model}``: 1 per model ready on a node;
* ``llamaswap_fleet_queue_depth{node,band}``: each node's waiting requests per band (its
  own published figure: this node's gauges sum to the fleet's queue);
* ``llamaswap_fleet_placed_total{node}``: requests this node sent to another node;
* ``llamaswap_fleet_records_delayed{node}``: records a node holds (journaled) because the
  shared database is away from it, as it last said: the history lacks them until then.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.node import current
from scheduler.core.priority import BANDS


class FleetCollector(Collector):
    def describe(self) -> Iterable[Metric]:
        return []  # collected at scrape time only (never at registration)

    def collect(self) -> Iterable[Metric]:
        fleet = current()
        if fleet is None:
            return []
        state = fleet.state()
        nodes = GaugeMetricFamily(
            "llamaswap_fleet_nodes", "Fleet nodes by state.", labels=["state"]
        )
        up = sum(1 for n in state["nodes"] if n["up"])
        nodes.add_metric(["up"], up)
        nodes.add_metric(["down"], len(state["nodes"]) - up)
        node_up = GaugeMetricFamily(
            "llamaswap_fleet_node_up", "1 while a node's heartbeat is fresh.", labels=["node"]
        )
        depth = GaugeMetricFamily(
            "llamaswap_fleet_queue_depth",
            "Requests waiting on each node, by band (the node's last view).",
            labels=["node", "band"],
        )
        loaded = GaugeMetricFamily(
            "llamaswap_fleet_model_loaded",
            "1 for each model loaded and ready on each node (the node's last view).",
            labels=["node", "model"],
        )
        running = GaugeMetricFamily(
            "llamaswap_fleet_running",
            "Requests being served on each node (the node's last view).",
            labels=["node"],
        )
        delayed = GaugeMetricFamily(
            "llamaswap_fleet_records_delayed",
            "Records a node holds because the shared database is away from it (its last word).",
            labels=["node"],
        )
        for row in state["nodes"]:
            delayed.add_metric([row["node"]], row["delayed"])
            node_up.add_metric([row["node"]], 1 if row["up"] else 0)
            running.add_metric([row["node"]], row["running"])
            for model in row["loaded"]:
                loaded.add_metric([row["node"], model], 1)
            for band in BANDS:
                depth.add_metric([row["node"], band.value], row["depth"][band.value])
        degraded = GaugeMetricFamily(
            "llamaswap_fleet_degraded", "1 while this node cannot reach the fleet's Redis."
        )
        degraded.add_metric([], 1 if state["degraded"] else 0)
        placed = CounterMetricFamily(
            "llamaswap_fleet_placed",
            "Requests this node sent to another node, by node.",
            labels=["node"],
        )
        for node, count in sorted(fleet.placed_to.items()):
            placed.add_metric([node], count)
        return [nodes, node_up, degraded, depth, running, loaded, placed, delayed]


COLLECTOR = FleetCollector()
REGISTRY.register(COLLECTOR)
