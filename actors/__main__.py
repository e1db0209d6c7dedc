"""One actor process: ``python -m actors --actor-id I [--config FILE] [overrides] [--connect EP] [--run-dir DIR]``,
started by the fleet (``bin/actors``). The config is parsed before torch is imported; SIGTERM/SIGINT end the loop
after the current policy call (the group is abandoned) and exit 0; any other exit code makes the fleet restart it."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m actors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. actor.temperature=1.0")
    ap.add_argument("--config", default=None, help="YAML config file (the fleet passes the resolved one)")
    ap.add_argument("--actor-id", type=int, required=True)
    ap.add_argument("--connect", default=None,
                    help="tcp://HOST:PORT (trajectory port; control = PORT+1) or TRAJ_EP,CONTROL_EP; "
                         "default: transport.connect_host and the configured ports")
    ap.add_argument("--run-dir", default=None, help="run directory (default: run.out_dir/run.name)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the fleet) is gone")
    args = ap.parse_args(argv)

    from async_vla.config import ConfigError, load_config, run_dir

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"actor {args.actor_id}: {exc}", file=sys.stderr)
        return 2
    import time

    from actors.status import parse_connect, status_path, write_status

    endpoints = parse_connect(args.connect) if args.connect else None
    rdir = Path(args.run_dir) if args.run_dir else run_dir(cfg)
    # Alive before the slow imports: the fleet sees a starting process, not a silent one.
    write_status(status_path(rdir, args.actor_id), {"actor_id": args.actor_id, "pid": os.getpid(),
                                                    "t": time.time(), "state": "starting"})
    threads = str(cfg.actor.torch_threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = threads  # before torch is imported: its thread pools read these once
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=cfg.logging.level,
                        format=f"%(asctime)s actor{args.actor_id} %(levelname)s %(name)s: %(message)s")

    from actors.actor import Actor  # imports torch

    stop = threading.Event()
    actor = Actor(cfg, args.actor_id, rdir, endpoints, stop_event=stop, parent_pid=args.parent_pid)

    def on_signal(signum: int, _frame) -> None:
        actor.request_stop(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return actor.run()


if __name__ == "__main__":
    sys.exit(main())
