"""The activity log and the metrics: one record per request that reached the queue, the
Prometheus series, both fed by dispatcher observers that never block the dispatch path."""
