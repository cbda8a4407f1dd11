"""The dispatcher's share of one request's critical path, in process.

``python -m bench.bench_admission [--steps N] [--rounds R] [--case USE:WAITING]``: a real
:class:`~scheduler.dispatcher.Dispatcher` over :class:`~scheduler.testing.FakeModelProcess`
(model ``m`` loaded), its log going through the site's :class:`KeyValueFormatter` into
memory, and a do-nothing observer. Cases: fifo and serial with nothing else waiting, and
serial with 1,000 lower-priority requests waiting.

With nothing waiting, one step is what a sequential client's view does: ``submit``,
``await ticket.wait()`` (the grant), ``finish``, then six loop turns (the dispatcher's
``Finished`` step and the deferred ``dispatch`` announcement: the INFO line and the
observers). Printed: ``submit → resumed`` (the view's ``wait()`` returns) and ``finish →
settled`` (the six turns). With 1,000 waiting, a top-priority request is submitted while
another runs; ``submit → resumed`` is then from the running one's ``finish`` to the new
one's grant (a job change with a long queue).

p50 and p90 µs per case; rounds alternate the cases so drift on the machine hits all
alike. On a shared machine wall time is noise: count instructions instead, one case
under ``valgrind --tool=callgrind`` at two ``--steps`` (``--rounds 1``), the difference
divided by the difference in steps.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import logging
import time

from bench import machine, quantile_us


class _Quiet:
    """An observer that does nothing (the callbacks' dispatch cost only)."""

    def on_enqueue(self, ticket: object) -> None: ...
    def on_dispatch(self, ticket: object) -> None: ...
    def on_finish(self, ticket: object) -> None: ...
    def on_model_state(self, model: str, state: object) -> None: ...
    def on_settings(self, settings: object, source: str) -> None: ...


def _logging() -> None:
    from llamaswap_site.logfmt import KeyValueFormatter

    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger = logging.getLogger("llamaswap")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


async def _case(use: str, waiting: int, steps: int) -> tuple[list[int], list[int]]:
    from scheduler.config import parse_config
    from scheduler.dispatcher import Dispatcher, Outcome
    from scheduler.testing import FakeProcessFactory

    models: dict[str, dict[str, object]] = {"m": {"cmd": "fake", "proxy": "http://127.0.0.1:9000"}}
    raw = {"models": models, "routing": {"scheduler": {"use": use}}}
    d = Dispatcher(parse_config(raw), process_factory=FakeProcessFactory(), observers=[_Quiet()])
    await d.start()
    m = d.config.models["m"]
    first = d.submit(m, 0, "warm", "/v1/chat/completions")
    await first.wait()
    hold = None
    if use == "serial" and waiting:
        hold = first  # busy: the others wait behind it
        backlog = [d.submit(m, -10, f"w{i}", "/v1/chat/completions") for i in range(waiting)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    else:
        d.finish(first, Outcome.COMPLETED, 200)
        backlog = []
    for _ in range(10):
        await asyncio.sleep(0)
    grant: list[int] = []
    finish: list[int] = []
    for i in range(steps):
        if hold is not None:
            # serial with a backlog: a top-priority request goes next when the running
            # one ends; measure from its submit (while busy) to its grant after finish
            t = d.submit(m, 100, f"s{i}", "/v1/chat/completions")
            await asyncio.sleep(0)
            t0 = time.perf_counter_ns()
            d.finish(hold, Outcome.COMPLETED, 200)
            await t.wait()
            grant.append(time.perf_counter_ns() - t0)
            hold = t
            t1 = time.perf_counter_ns()
            for _ in range(6):
                await asyncio.sleep(0)
            finish.append(time.perf_counter_ns() - t1)
            continue
        t0 = time.perf_counter_ns()
        t = d.submit(m, 0, f"s{i}", "/v1/chat/completions")
        await t.wait()
        grant.append(time.perf_counter_ns() - t0)
        t1 = time.perf_counter_ns()
        d.finish(t, Outcome.COMPLETED, 200)
        for _ in range(6):
            await asyncio.sleep(0)
        finish.append(time.perf_counter_ns() - t1)
    if hold is not None:
        d.finish(hold, Outcome.COMPLETED, 200)
    for t in backlog:
        d.cancel(t)
    await d.stop(grace=0)
    return grant, finish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--case", help="one case only, as USE:WAITING (e.g. fifo:0)")
    args = parser.parse_args()
    _logging()
    cases = [("fifo", 0), ("serial", 0), ("serial", 1000)]
    if args.case:
        use, waiting = args.case.split(":")
        cases = [(use, int(waiting))]
    results: dict[tuple[str, int], tuple[list[int], list[int]]] = {c: ([], []) for c in cases}
    gc.freeze()
    for _ in range(args.rounds):
        for use, waiting in cases:
            g, f = asyncio.run(_case(use, waiting, args.steps))
            results[use, waiting][0].extend(g)
            results[use, waiting][1].extend(f)
    print(f"machine: {machine()}")
    print("| case | submit (or finish) → resumed p50 / p90 µs | finish → settled p50 / p90 µs |")
    print("| :-- | --: | --: |")
    for (use, waiting), (g, f) in results.items():
        label = f"{use}, {waiting} waiting"
        print(
            f"| {label} | {quantile_us(g, 0.5):.1f} / {quantile_us(g, 0.9):.1f} "
            f"| {quantile_us(f, 0.5):.1f} / {quantile_us(f, 0.9):.1f} |"
        )


if __name__ == "__main__":
    main()
