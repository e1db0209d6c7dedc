"""Expert demos in the trajectory format (LIBERO), their action statistics, and SFT samples. A demo is a
``Trajectory`` as a chunk-``C`` actor would send it (one row per decision point, the expert's next C actions as
OpenVLA tokens under statistics from the demos themselves); on disk the buffer's recording format plus
``demos.json`` (statistics, the (task, init state) of every demo, the expert's success counts)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from async_vla.envs.base import Observation
from async_vla.messages import Trajectory, decode, encode
from async_vla.progress import Progress
from async_vla.tokenizer import ActionStats, ActionTokenizer

DEMO_STATS_KEY = "libero_demos"


@dataclass
class RawDemo:
    """One expert episode before tokenisation."""

    task_id: int
    init_state_id: int
    instruction: str
    observations: list[Observation]  # at decision points: before steps 0, C, 2C, ...
    actions: np.ndarray  # float32 [L, dof], in the env's action convention
    success: bool


def record_expert_demos(env, episodes: Sequence[tuple[int, int]], chunk_size: int,
                        log: Optional[Callable[[str], None]] = None,
                        progress: Optional[str] = None) -> tuple[list[RawDemo], dict]:
    """Run the scripted expert on ``episodes`` (task, init state) of a LiberoEnv, rendering only at decision points;
    failures are counted in the report and left out. ``log(message)`` after every episode; ``progress``: a label."""
    from async_vla.envs.libero_expert import expert_episode

    demos, report = [], {"attempted": 0, "succeeded": 0, "failed": [], "wall_s": 0.0}
    t0 = time.perf_counter()
    with Progress(progress, len(episodes), "demos") as bar:
        for task_id, init_id in episodes:
            observations, actions, success = expert_episode(env, task_id, init_id, observe_every=chunk_size)
            report["attempted"] += 1
            if success:
                report["succeeded"] += 1
                demos.append(RawDemo(int(task_id), int(init_id), env.instruction(task_id), observations,
                                     np.asarray(actions, dtype=np.float32), True))
            else:
                report["failed"].append([int(task_id), int(init_id)])
            if log is not None:
                bar.clear()
                log(f"demo task {task_id} init {init_id}: " + (
                    f"{len(actions)} steps, {len(observations)} decision points" if success
                    else f"the expert FAILED ({len(actions)} steps), left out"))
            bar.update(info=f"{report['succeeded']} succeeded")
    report["wall_s"] = time.perf_counter() - t0
    return demos, report


def demo_action_stats(demos: Sequence[RawDemo]) -> ActionStats:
    """OpenVLA-style BOUNDS_Q99 statistics of every demo action (gripper passed through)."""
    return ActionStats.from_actions(np.concatenate([d.actions for d in demos]), gripper_last=True)


def demo_chunks(demo: RawDemo, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(actions [N, C, dof], executed [N, C]) of a demo's N decision points; past the end: hold still with the
    last gripper command (never executed, masked)."""
    n_calls = len(demo.observations)
    length, dof = demo.actions.shape
    hold = np.zeros((n_calls * chunk_size, dof), dtype=np.float32)
    hold[:, -1] = demo.actions[-1, -1]
    padded = np.concatenate([demo.actions, hold])[: n_calls * chunk_size]
    executed = np.arange(n_calls * chunk_size) < length
    return padded.reshape(n_calls, chunk_size, dof), executed.reshape(n_calls, chunk_size)


def demos_to_trajectories(demos: Sequence[RawDemo], tokenizer: ActionTokenizer,
                          run_id: str = "expert-demos") -> list[Trajectory]:
    """Tokenise demos into ``Trajectory`` messages that pass the wire schema: version 0, behaviour log-probs 0 (the
    expert is deterministic), group size 2 (the schema's minimum; ``group_id`` numbers the demos)."""
    out = []
    dof = tokenizer.action_dim
    for k, d in enumerate(demos):
        chunks, executed = demo_chunks(d, tokenizer.chunk_size)
        tokens = tokenizer.encode_actions(chunks)
        n = tokens.shape[0]
        wrist = None
        if all(o.wrist_image is not None for o in d.observations):
            wrist = np.stack([o.wrist_image for o in d.observations]).astype(np.uint8)
        out.append(Trajectory(
            run_id=run_id, actor_id=0, group_id=f"demo-{k}", traj_id=f"demo-{k}/m0", task_id=d.task_id,
            init_state_id=d.init_state_id, instruction=d.instruction, behaviour_version=0, success=d.success,
            reward=1.0 if d.success else 0.0, env_steps=int(d.actions.shape[0]), t_start=0.0, t_end=0.0,
            group_size=2, chunk_versions=np.zeros(n, dtype=np.int64),
            images=np.stack([o.image for o in d.observations]).astype(np.uint8),
            proprio=np.stack([o.proprio for o in d.observations]).astype(np.float32),
            action_tokens=tokens.astype(np.int64), behav_logprobs=np.zeros(tokens.shape, dtype=np.float32),
            token_mask=np.repeat(executed, dof, axis=1), wrist_images=wrist))
    return out


def save_demos(directory: Union[str, Path], trajectories: Sequence[Trajectory], stats: ActionStats,
               meta: dict) -> Path:
    from async_vla.buffer.recording import Recorder

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rec = Recorder(directory / "recording", file_bytes=1 << 30, max_files=1000, meta={"kind": "expert_demos"})
    try:
        for traj in trajectories:
            rec.write(0.0, encode(traj))
    finally:
        rec.close()
    info = {"stats_key": DEMO_STATS_KEY, "action_stats": stats.to_dict(), "num_demos": len(trajectories),
            "episodes": [[t.task_id, t.init_state_id] for t in trajectories], **meta}
    (directory / "demos.json").write_text(json.dumps(info, indent=1))
    return directory


def load_demos(directory: Union[str, Path]) -> tuple[list[Trajectory], ActionStats, dict]:
    from async_vla.buffer.recording import iter_recording

    directory = Path(directory)
    info_path = directory / "demos.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{directory} holds no demos.json: make demos with bin/libero-demos --out {directory}")
    info = json.loads(info_path.read_text())
    trajs = [decode(frames) for frames in iter_recording(directory / "recording")]
    if len(trajs) != info["num_demos"]:
        raise ValueError(f"{directory}: demos.json lists {info['num_demos']} demos, the recording holds {len(trajs)}")
    return trajs, ActionStats.from_dict(info["action_stats"]), info


def trajectories_to_samples(trajectories: Sequence[Trajectory]):
    """SFT samples (one per decision point) carrying the demo tokens; see ``async_vla.sft.DemoSamples``."""
    from async_vla.sft import DemoSamples

    images, proprio, instr, tokens, masks, tids = [], [], [], [], [], []
    for t in trajectories:
        for k in range(t.num_calls):
            images.append(t.images[k])
            proprio.append(t.proprio[k])
            instr.append(t.instruction)
            tokens.append(t.action_tokens[k])
            masks.append(t.token_mask[k])
            tids.append(t.task_id)
    return DemoSamples(np.stack(images), np.stack(proprio).astype(np.float32), instr, actions=None,
                       task_ids=tids, tokens=np.stack(tokens), token_mask=np.stack(masks))


__all__ = ["DEMO_STATS_KEY", "RawDemo", "demo_action_stats", "demo_chunks", "demos_to_trajectories", "load_demos",
           "record_expert_demos", "save_demos", "trajectories_to_samples"]
