"""The group-assembling replay buffer as its own process, until SIGINT/SIGTERM/SIGHUP:

    python -m async_vla.buffer CONFIG [section.field=value ...] --run-dir DIR     (or bin/buffer, the same)

Binds the trajectory (PULL), control (ROUTER) and batch (ROUTER) endpoints from the transport config, writes the
resolved config to DIR/config.yaml, serves, and writes DIR/ledger.json periodically and at exit. Change eta live with
`echo 4 > DIR/control/max_staleness` or a ControlCommand("set_max_staleness", 4) signed with the run's learner secret
(DIR/secrets/learner, created here if the learner has not yet: async_vla/learner_secret.py). Imports no torch.
"""

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger("async_vla.buffer")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m async_vla.buffer", description=__doc__.split("\n")[0])
    parser.add_argument("config", metavar="CONFIG", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. buffer.max_staleness=4")
    parser.add_argument("--run-dir", required=True, help="run directory (ledger, recording, control file)")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the --options

    from async_vla.config import ConfigError, load_config, write_resolved

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = Path(args.run_dir)
    write_resolved(cfg, run_dir)

    from async_vla.buffer.service import BufferService, keep_trajectory_memory
    from async_vla.transport import CurveKeys, endpoints

    if not keep_trajectory_memory():
        log.warning("buffer: this C library has no glibc mallopt: every received trajectory is a fresh mapping "
                    "(page faults: more CPU per trajectory)")

    keys = CurveKeys.load(cfg.transport.curve_dir, "server") if cfg.transport.curve else None
    eps = endpoints(cfg.transport, run_dir, side="bind")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # a closed terminal stops it cleanly too
        signal.signal(sig, lambda *_: stop.set())

    monitor = None
    if cfg.logging.tensorboard:
        from async_vla.metrics import Monitor
        monitor = Monitor(run_dir, enabled=True)

    service = BufferService(cfg, run_dir, eps["trajectory"], eps["control"], eps["batch"],
                            valid_task_ids=cfg.env.task_ids, keys=keys)

    def status(metrics: dict) -> None:
        step = int(metrics.get("buffer/learner_version", 0))
        log.info(
            "v=%d received=%d trained=%d pending=%d ready=%d in_flight=%d held=%.1fMB eta=%d", step,
            metrics["buffer/received"], metrics["buffer/trained"], metrics["buffer/pending"],
            metrics["buffer/groups_ready"], metrics["buffer/groups_in_flight"], metrics["buffer/held_bytes"] / 2**20,
            metrics["buffer/max_staleness"])
        if monitor is not None:
            monitor.scalars(metrics, step)
            lags = [lag for lag, n in service.buffer.lag_histogram.items() for _ in range(n)]
            if lags:
                monitor.histogram("buffer/trained_lag", lags, step)

    print(f"buffer: trajectories {service.trajectory_endpoint}  control {service.control_endpoint}  batches "
          f"{service.batch_endpoint}", flush=True)
    files = None
    if cfg.transport.weights_fetch_port is not None:   # weights for actors without this run directory
        from async_vla.weights.files import WeightsFileServer

        files = WeightsFileServer(run_dir / "weights", f"tcp://{cfg.transport.host}:{cfg.transport.weights_fetch_port}",
                                  keys=keys)
        print(f"buffer: weights exports served on {files.endpoint}", flush=True)
    try:
        service.serve(stop, on_status=status)
    finally:
        service.close()
        if files is not None:
            files.close()
        if monitor is not None:
            monitor.close()
    print(f"buffer: ledger written to {run_dir / 'ledger.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
