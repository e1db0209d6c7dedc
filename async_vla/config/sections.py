"""Typed config sections; every field's docstring is its help in docs/CONFIG.md. Unknown keys are errors (a typo such
as ``loss.eps_hgh=0.3`` fails at load, naming it); checks spanning sections live in ``schema.py``."""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base for every section: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunConfig(Section):
    name: str = "run"
    """Run name; the run directory is ``<out_dir>/<name>``."""
    out_dir: str = "runs"
    """Parent directory of run directories (resolved config, logs, TensorBoard events, checkpoints)."""
    seed: int = Field(0, ge=0)
    """Global seed; each actor derives its own stream from (seed, actor id)."""
    mode: Literal["async", "sync", "serial"] = "async"
    """async: actors and learner overlap (bounded staleness). sync: actors wait for every new
    version (staleness 0, the baseline). serial: every component in one process, one thread."""
    max_versions: int = Field(50, ge=1)
    """Stop after the learner has produced this many policy versions (optimizer steps)."""
    max_wall_s: float = Field(600.0, gt=0)
    """Stop training after this many seconds of wall time (counted by the learner), whichever comes first. Final
    checkpoint, export, evaluation and shutdown come after it: leave a job scheduler's limit room beyond this."""
    eval_envs: Optional[int] = Field(None, ge=1)
    """Simulators bin/train's evaluator (and bin/eval) runs held-out episodes on, in parallel (None = the group
    size, at most 8). LIBERO envs run in their own worker processes (env.worker; their memory: docs/LIBERO.md)."""
    eval_every: int = Field(5, ge=0)
    """Greedy evaluation on held-out init states every this many versions (0 = only at start and end). async/sync: the
    learner keeps each multiple's export in <run>/weights/milestones/ until the evaluator scored it (late: the
    newest)."""
    eval_at_start: bool = True
    """Evaluate the initial policy before training starts. False: it is scored afterwards from weights/v0.safetensors
    (async/sync, while weights.export_keep allows: bin/eval RUN --versions 0 --record; serial mode loses it)."""
    checkpoint_every: int = Field(10, ge=0)
    """Save a resumable checkpoint every this many versions (0 = only at the end)."""
    pin_cores: bool = False
    """Pin the learner ranks and the buffer to CPU core 0 and the actor fleet to the other cores (bin/train;
    used by the async-vs-sync benchmark so each side gets exactly one core on a 2-core host)."""
    serial_lag: int = Field(0, ge=0)
    """run.mode=serial only: the actor samples with the weights of this many versions ago, so the learner trains on data
    exactly this stale, deterministically (isolates what staleness does). 0 = on-policy."""
    target_success: Optional[float] = Field(None, gt=0, le=1)
    """Stop early once greedy eval success reaches this *and* an independent evaluation of that version on the built-in
    env's disjoint ``confirm`` split does too (None = never). Needs env.kind=builtin and run.eval_split=eval."""
    eval_split: Literal["eval", "val"] = "eval"
    """Which init states the run's greedy evaluations use: eval = the held-out set (what is reported); val = the
    built-in env's validation set (for tuning, so nothing is tuned on the held-out set)."""
    launcher: Literal["local", "ray"] = "local"
    """async/sync: local = bin/train starts buffer, learner and actors as processes on this host; ray = as Ray
    actors on an existing Ray cluster (section ``ray``; README "Multi-host"), restarted by Ray on failure."""


class EnvConfig(Section):
    kind: Literal["builtin", "libero"] = "builtin"
    """Simulator: the fast built-in tabletop task family, or real LIBERO (needs the `libero` extra)."""
    suite: Literal["spatial", "object", "goal", "10", "90"] = "spatial"
    """LIBERO suite (env.kind=libero only)."""
    task_ids: Optional[list[int]] = None
    """Task ids to train on (None = every task of the suite / built-in family)."""
    num_train_init_states: int = Field(40, ge=1)
    """Init states per task of the train split (demos, SFT, RL rollouts; LIBERO: the first n of its 50 fixed
    states). actor.num_init_states narrows what RL practises to the first few of them."""
    num_eval_init_states: int = Field(10, ge=1)
    """Held-out init states per task used only for greedy evaluation (never trained on; LIBERO: the last n).
    Built-in: layouts whose blocks lie in held-out cells of the layout space (async_vla/envs/builtin.py)."""
    num_val_init_states: int = Field(10, ge=1)
    """Built-in only: validation init states per task (val cells of the layout space, disjoint from train and
    held-out); evaluated instead of the held-out set with run.eval_split=val, for tuning."""
    max_steps: Optional[int] = Field(None, ge=1)
    """Episode step limit (None = the suite's default)."""
    image_size: int = Field(32, ge=8, le=512)
    """Square camera image resolution in pixels."""
    render_size: Optional[int] = Field(None, ge=8, le=1024)
    """LIBERO: resolution the cameras render at, resized to image_size with Lanczos (None = image_size;
    OpenVLA-OFT renders 256 and feeds 224)."""
    image_orientation: Literal["rot180", "vflip"] = "rot180"
    """LIBERO: rot180 = img[::-1, ::-1] as OpenVLA's LIBERO pipeline (and its training data) expects;
    vflip = the true camera view (MuJoCo returns rows bottom-up)."""
    jpeg_roundtrip: bool = False
    """LIBERO: JPEG-encode and decode each frame (quality 95) before the resize to image_size, as OpenVLA-OFT's and
    SimpleVLA-RL's LIBERO pipelines do (their training images were stored as JPEG; docs/FIDELITY.md)."""
    wrist_camera: bool = False
    """Also record the wrist camera image (LIBERO)."""
    render_mode: Literal["full", "cheap"] = "full"
    """LIBERO render fidelity. cheap: no shadows, reflections, skybox or multisampling (faster; images differ from what
    published checkpoints saw: for CPU/smoke runs only). Speeds: docs/LIBERO.md."""
    render_at: Literal["every_step", "decision"] = "every_step"
    """LIBERO camera rendering. every_step: robosuite's behaviour. decision: ``step_chunk`` renders only the step whose
    observation the policy reads (pixel-equal images, tests/test_libero.py; the speed-up: docs/LIBERO.md)."""
    mujoco_gl: Literal["auto", "egl", "osmesa"] = "auto"
    """Offscreen GL backend for MuJoCo (auto: egl if it works, else osmesa)."""
    hard_reset: bool = False
    """LIBERO: rebuild the MuJoCo model on every reset (robosuite's default; much slower; a soft reset gives the same
    physical state, tests/test_libero.py). Fixture placement varies per reset either way unless pin_fixtures."""
    pin_fixtures: bool = False
    """LIBERO: draw the static fixtures' placement (a cabinet, a stove) from a seed of (suite, task, init state), so an
    init state always shows the same scene. False = LIBERO's own behaviour: a fresh placement at every reset."""
    scene_variant: int = Field(0, ge=0)
    """LIBERO with pin_fixtures: which pinned placement of the fixtures each init state shows (0: the scenes RL
    practises). Another variant is another scene of the same init state: held-out readouts over variants 0..k-1
    give k distinct scenes per init state (bin/libero-cpu --heldout-variants)."""
    single_forward: bool = True
    """LIBERO: skip robosuite's second mj_forward per physics substep at the same state (the controller's pass
    recomputes only the acceleration stage); bit-identical (tests/test_libero.py). Needs robosuite 1.4.0; false =
    robosuite's loop."""
    gripper_convention: Literal["openvla", "libero"] = "openvla"
    """LIBERO action[6]: openvla = [0, 1] with 1 open (converted to LIBERO's -1 open / +1 close);
    libero = already in LIBERO's [-1, 1], +1 close."""
    step_timeout_s: float = Field(30.0, gt=0)
    """A single env step slower than this counts as a hung simulator and the env is restarted."""
    worker: Literal["auto", "subprocess", "inline"] = "auto"
    """Where an actor runs each env: subprocess (isolated: a crash or hang costs one env, see
    actors/env_worker.py), inline (in the actor process), auto (subprocess for libero, inline for builtin)."""
    worker_start_timeout_s: float = Field(300.0, gt=0)
    """Seconds an env worker may take to start and build its simulator (slow for LIBERO on a loaded CPU)."""
    settle_steps: int = Field(10, ge=0)
    """No-op steps after reset so objects settle (LIBERO evaluations use 10)."""
    envs_per_actor: int = Field(8, ge=1)
    """Environments stepped in lock-step inside one actor (usually the group size)."""


class PolicyConfig(Section):
    arch: Literal["tiny", "openvla", "openvla_oft"] = "tiny"
    """tiny: OpenVLA-shaped random-init model for CPU. openvla/openvla_oft: load `path` via transformers."""
    path: Optional[str] = None
    """Directory of a saved checkpoint (ours or an OpenVLA/OFT HF directory) to start from."""
    decoding: Literal["parallel", "autoregressive"] = "parallel"
    """parallel: OFT-style one forward pass over all action tokens. autoregressive: OpenVLA-style."""
    hidden_size: int = Field(128, ge=8)
    """Decoder hidden size (tiny arch)."""
    num_layers: int = Field(2, ge=1)
    """Decoder layers (tiny arch)."""
    num_heads: int = Field(4, ge=1)
    """Attention heads (tiny arch)."""
    intermediate_size: int = Field(256, ge=8)
    """MLP width (tiny arch)."""
    patch_size: int = Field(8, ge=1)
    """Vision encoder patch size in pixels (tiny arch)."""
    patch_tokens: bool = True
    """Tiny arch: feed the image's patch tokens to the decoder. false = the image enters through the keypoint tokens
    alone (needs keypoints > 0): object positions as numbers only, no per-patch features to memorise layouts with,
    and a much shorter prefix (a cheaper step)."""
    patch_pos: Literal["learned", "sincos"] = "learned"
    """Tiny arch: position code added to each patch token. learned = one free vector per patch (a patch where no
    object appeared in training keeps an untrained code); sincos = fixed 2-D sine-cosine code of the patch's row
    and column (MAE's), smooth across the grid."""
    vocab_size: int = Field(32000, ge=256)
    """Language-model vocabulary; the last `num_bins` ids are the action tokens (OpenVLA: 31744..31999)."""
    num_bins: int = Field(256, ge=2)
    """Action discretisation bins per dimension."""
    chunk_size: int = Field(8, ge=1)
    """Action steps predicted per policy call."""
    action_dim: int = Field(7, ge=1)
    """Degrees of freedom per action step (xyz, rpy, gripper)."""
    unnorm_key: Optional[str] = None
    """Dataset key of the action normalisation statistics (None = the task family's own). OpenVLA checkpoints: a key of
    their statistics; ``libero_X`` falls back to ``libero_X_no_noops`` (as SimpleVLA-RL does)."""
    center_crop: bool = False
    """OpenVLA(-OFT) checkpoints trained with random crops: centre-crop 0.9 of each frame's area and resize it back
    before the processor, as SimpleVLA-RL's rollout does (docs/FIDELITY.md)."""
    proprio_dim: int = Field(8, ge=1)
    """Proprioception vector length fed to the tiny arch (builtin env and LIBERO: 8 = eef xyz, axis-angle, 2
    gripper)."""
    max_instruction_tokens: int = Field(16, ge=2)
    """Tiny arch: instruction words (hashed, word-level) kept per prompt, padded to this length (incl. BOS)."""
    word_buckets: int = Field(2048, ge=16)
    """Tiny arch: rows of the hashed instruction-word embedding (each word sums two hashed rows)."""
    keypoints: int = Field(16, ge=0)
    """Tiny arch: spatial-softmax keypoint tokens added to the patch tokens (expected x, y of K learned feature
    maps: object positions as numbers, which a from-scratch model otherwise struggles to read); 0 = off."""
    lang_keypoints: int = Field(2, ge=0)
    """Tiny arch: instruction-conditioned keypoints: the instruction picks a mix of the K keypoint feature maps whose
    spatial softmax gives "where the thing the instruction names is" (needs keypoints > 0); 0 = off."""
    action_head: Literal["fourier", "fourier_shift", "free"] = "fourier"
    """Tiny arch: fourier = action-token embeddings as a learned map of a Fourier basis of the bin index (logits smooth
    across neighbouring bins); fourier_shift = the same, with the basis shifted along the bins by a learned linear
    readout of each action position's hidden state, so where the distribution peaks can follow an object's position
    linearly, also outside the positions seen in training (starts equal to fourier); free = one independent
    embedding row per bin."""
    action_head_freqs: int = Field(24, ge=1)
    """Tiny arch, fourier head: frequencies of the basis (higher = sharper possible peaks over the 256 bins)."""
    keypoint_shift: bool = False
    """Tiny arch, fourier_shift head: add to each action position's shift a linear readout of the keypoint
    coordinates themselves (needs keypoints > 0), beside the hidden state's: a direct linear path from where an
    object is to where the action peaks, as in spatial-softmax visuomotor policies, which extrapolates to object
    positions outside the training ones (starts at zero; the coordinates enter divided by 16, the scale of a reach
    on the built-in table)."""


class ActorConfig(Section):
    num_actors: int = Field(1, ge=1)
    """Actor processes started by the fleet on this host."""
    group_size: int = Field(8, ge=2)
    """G: rollouts per group, all from the same init state."""
    temperature: float = Field(1.6, ge=0)
    """Rollout sampling temperature (SimpleVLA-RL: 1.6); 0 = greedy."""
    sampled_dims: Optional[list[int]] = None
    """Action dimensions sampled at `temperature` (e.g. [0, 1, 2, 6]: translation and gripper); the others are
    taken greedily (argmax) and left out of the loss (their tokens' `token_mask` is False), so the policy gradient
    covers only the explored dimensions. None = every dimension sampled (SimpleVLA-RL). docs/LIBERO.md."""
    task_ids: Optional[list[int]] = None
    """The tasks the actors practise (a subset of env.task_ids); None = every task of env.task_ids. Demos, SFT and
    the held-out evaluations keep env.task_ids: an RL run can practise one task of a start trained on several."""
    num_init_states: Optional[int] = Field(None, ge=1)
    """Practise the first N train init states of each task (at most env.num_train_init_states); None = all of
    them. `bin/eval --split practised` reads out exactly these scenes."""
    init_state_ids: Optional[list[int]] = None
    """Practise exactly these train init states of each task (distinct, in 0..env.num_train_init_states-1), e.g.
    the ones where the start's sampled success is inside the band where groups are mixed; instead of
    actor.num_init_states. `bin/eval --split practised` reads out exactly these scenes."""
    image_shift: int = Field(0, ge=0)
    """Random-shift augmentation (DrQ / RAD) of training rollouts, in pixels: before each policy call the observation
    image (and the wrist image, if any) is edge-padded by this many pixels and cropped back at a random offset
    (`async_vla.image_ops.random_shift`, seeded per actor from run.seed). The trajectory stores the shifted image the
    actor acted on, so the learner scores exactly that input. Evaluations never shift. 0 = off; must be smaller than
    env.image_size."""
    swap: Literal["between_chunks", "between_episodes"] = "between_chunks"
    """When an actor swaps in new weights: between policy calls, or only between episodes."""
    backend: Literal["torch", "vllm"] = "torch"
    """Inference backend: torch (CPU/GPU) or vllm (GPU, `gpu` extra; OpenVLA checkpoints, policy.arch=openvla:
    see README "vLLM on GPU hosts")."""
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """actor.backend=vllm: fraction of the GPU the in-process vLLM engine may take (weights + KV cache); the rest stays
    for the torch copy of the policy and the weight receive buffers."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per actor (more threads than cores make step times swing widely)."""
    heartbeat_s: float = Field(1.0, gt=0)
    """Seconds between actor heartbeats."""
    hung_after_s: float = Field(60.0, gt=0)
    """The fleet restarts an actor whose heartbeat is older than this."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """First restart delay; doubles on each fast crash up to 30 s."""
    max_fast_crashes: int = Field(5, ge=1)
    """Give up on an actor that crashed this many times in a row within `fast_crash_s` of starting."""
    fast_crash_s: float = Field(10.0, gt=0)
    """An actor that dies sooner than this after its start counts as a fast crash (back-off doubles)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """The fleet restarts an actor that has not written its first heartbeat this long after its start
    (importing torch and building envs can take a while on a loaded host)."""
    stop_timeout_s: float = Field(10.0, gt=0)
    """On shutdown the fleet waits this long for actors to exit after SIGTERM, then kills them."""
    stats_every_s: float = Field(5.0, gt=0)
    """Seconds between ActorStats messages (throughput, time by phase, success by task)."""
    grant_timeout_s: float = Field(5.0, gt=0)
    """An unanswered GrantRequest is sent again after this long (the buffer may have restarted)."""
    send_timeout_s: float = Field(0.5, gt=0)
    """Slice of a blocked trajectory send; between slices the actor heartbeats and checks for stop
    (a full buffer pushes back: the actor retries forever and counts the wait as idle time)."""


class BufferConfig(Section):
    groups_per_batch: int = Field(4, ge=1)
    """B: groups in one learner batch (split evenly across learner ranks)."""
    max_staleness: int = Field(2, ge=0)
    """eta: groups whose oldest behaviour version lags the learner by more are never trained on."""
    max_staleness_limit: int = Field(16, ge=0)
    """Ceiling on eta: max_staleness, and every live change of it (ControlCommand set_max_staleness, the file
    <run>/control/max_staleness), must lie in [0, this]; a change above it is refused with an error naming it."""
    pacing: bool = True
    """Grant new groups only while started-unfinished + accepted <= (eta + v + 1) * B."""
    group_timeout_s: float = Field(120.0, gt=0)
    """A partial group older than this expires (its actor died) and is counted."""
    dynamic_sampling: bool = True
    """Keep only mixed-outcome groups (0 < #success < G)."""
    difficulty_mask: Optional[Tuple[float, float]] = None
    """Keep groups whose success rate lies strictly inside (lo, hi), e.g. (0.1, 0.95). None = off."""
    max_groups: int = Field(256, ge=1)
    """Memory bound in complete groups held; above it the buffer stops reading its socket."""
    max_bytes: int = Field(2 * 1024**3, ge=1024)
    """Memory bound in bytes of held trajectories. Checked at load to hold one batch (groups_per_batch x group_size x
    the longest trajectory); 2-3 batches let actors run ahead (the LIBERO configs set ~2.5)."""
    reuse: int = Field(1, ge=1)
    """Times a group may be trained on (1 = once)."""
    order: Literal["fifo", "lifo"] = "fifo"
    """Batch order over admitted groups."""
    record: bool = False
    """Append every received trajectory (wire format) to <run>/recording/."""
    record_file_bytes: int = Field(256 * 1024**2, ge=1024)
    """Rotate recording files at this size."""
    record_max_files: int = Field(16, ge=1)
    """Keep at most this many recording files (oldest deleted)."""
    grant_retry_s: float = Field(0.5, gt=0)
    """retry_after_s sent with an empty admission grant (pacing says "not now")."""
    max_groups_per_actor: int = Field(4, ge=1)
    """Granted-and-unfinished groups one actor may hold (an actor runs one group at a time and asks for one
    more when it starts it); a GrantRequest wanting more gets at most the difference and an error saying so."""
    reclaim_after_s: float = Field(180.0, gt=0)
    """Service: an actor silent this long loses its open groups (granted ones with no member are "reclaimed", partial
    ones expire). At least actor.hung_after_s."""
    remember_closed_groups: int = Field(10000, ge=1)
    """Closed group ids (with their trajectory ids) kept to recognise late duplicates and stragglers."""
    check_run_id: bool = True
    """Count trajectories whose run_id differs from this run's as malformed ("wrong_run")."""
    expire_every_s: float = Field(1.0, gt=0)
    """Service: seconds between sweeps that expire partial groups older than group_timeout_s."""
    ledger_every_s: float = Field(1.0, gt=0)
    """Service: seconds between rewrites of <run>/ledger.json (also written at exit): a kill -9 of the buffer
    loses the counts of at most this long (the recording, when on, is flushed every busy step)."""
    control_poll_s: float = Field(1.0, gt=0)
    """Service: seconds between checks of the file <run>/control/max_staleness (live eta changes)."""

    @model_validator(mode="after")
    def _check_mask(self) -> "BufferConfig":
        if self.difficulty_mask is not None:
            lo, hi = self.difficulty_mask
            if not 0.0 <= lo < hi <= 1.0:
                raise ValueError(f"difficulty_mask must satisfy 0 <= lo < hi <= 1, got {self.difficulty_mask}")
        return self


class LearnerConfig(Section):
    num_ranks: int = Field(1, ge=1)
    """Data-parallel learner ranks (processes)."""
    zero_stage: int = Field(3, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    lr: float = Field(5e-6, gt=0)
    """AdamW learning rate (SimpleVLA-RL: 5e-6)."""
    lr_decay: Optional[Tuple[int, int]] = None
    """(start, end) learner versions of a linear decay: the update that makes version v + 1 uses ``lr`` while
    v <= start, then an lr falling linearly to ``lr_final`` at v = end, and ``lr_final`` after. Version-based, so a
    resumed run continues the same schedule. None: constant ``lr``."""
    lr_final: float = Field(0.0, ge=0)
    """The learning rate at the end of ``lr_decay``."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: Tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip. Size it to the policy's gradient norm (``learner/grad_norm`` in TensorBoard): far
    below it, the clip binds on every step and every parameter's update is divided by the global norm, which then
    follows whichever parameters' gradients are largest (a fourier_shift head's: configs/quickstart.yaml)."""
    minibatches: int = Field(1, ge=1)
    """PPO mini-batches per batch (verl's ppo_mini_batch_size = batch / minibatches): one optimizer step per shard of
    whole groups, all against the batch-start proximal log-probs; one version per batch. Multiple of num_ranks
    needed."""
    steps_per_batch: int = Field(1, ge=1)
    """Passes over each batch (verl's ppo_epochs): each pass takes learner.minibatches optimizer steps; all
    against the batch-start proximal log-probs, one version per batch."""
    proximal_pass: Literal["auto", "always"] = "auto"
    """pi_prox's log-probs. always: a no-grad forward before the first optimizer step. auto: skip that pass when the
    step's own forward gives them (one optimizer step per batch, loss.correction none or tis): same update
    (docs/LEARNER.md)."""
    micro_batch_trajectories: int = Field(16, ge=1)
    """Trajectories per forward/backward micro-batch (gradient accumulation over the rest)."""
    lora_rank: int = Field(0, ge=0)
    """LoRA rank of peft adapters on the language model's linear layers (q/k/v/o, gate/up/down); only they train
    and actors receive merged weights (learner/adapt.py). 0 = full fine-tuning."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank (OpenVLA's LoRA runs: 16)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (what that saves
    for a 7B OpenVLA-OFT micro-batch: docs/GPU.md)."""
    deepspeed_config: Optional[str] = None
    """Path to a user DeepSpeed JSON that replaces the generated one."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 on GPU, fp32 on CPU."""
    backend: Literal["deepspeed", "torch"] = "deepspeed"
    """deepspeed: ZeRO engine. torch: plain single-process AdamW (serial mode and debugging)."""
    zero3_persistence_threshold: int = Field(100_000, ge=0)
    """ZeRO-3: parameters with fewer elements than this stay whole on every rank instead of being
    partitioned (DeepSpeed stage3_param_persistence_threshold); 0 partitions every parameter."""
    keep_checkpoints: int = Field(2, ge=1)
    """Resumable checkpoints kept in <run>/checkpoints (older ones are deleted after a successful save)."""
    checkpoint_digest: bool = True
    """Record sha256 digests of the parameters and optimizer state with every checkpoint and check them on --resume
    (<run>/learner_resume_rank<r>.json). One extra hash pass per checkpoint."""
    batch_timeout_s: float = Field(1.0, gt=0)
    """How long one BatchRequest waits at the buffer for a full batch before answering not-ready."""
    reply_grace_s: float = Field(10.0, gt=0)
    """No reply this long past batch_timeout_s: the learner assumes the buffer restarted and reconnects. Must exceed one
    rank's batch time on the wire (~1 GB at 1 GbE is ~10 s), or the reply is dropped and asked for again forever."""
    dist_timeout_s: float = Field(1800.0, gt=0)
    """torch.distributed timeout of the learner ranks' collectives (a rank that never arrives fails them)."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per learner rank on CPU (more threads than cores make step times swing widely)."""

    @model_validator(mode="after")
    def _check_lr_decay(self) -> "LearnerConfig":
        if self.lr_decay is not None:
            start, end = self.lr_decay
            if not 0 <= start < end:
                raise ValueError(f"lr_decay must be (start, end) versions with 0 <= start < end, got "
                                 f"{list(self.lr_decay)}: e.g. learner.lr_decay=[24,40]")
        if self.lr_final > self.lr:
            raise ValueError(f"lr_final ({self.lr_final}) must not exceed lr ({self.lr}): lr_decay lowers the lr")
        return self


class LossConfig(Section):
    eps_low: float = Field(0.2, gt=0, lt=1)
    """Lower clip: ratios below 1 - eps_low are clipped."""
    eps_high: float = Field(0.28, gt=0)
    """Upper clip ("clip-higher"): ratios above 1 + eps_high are clipped."""
    dual_clip: Optional[float] = Field(None, gt=1)
    """Dual-clip constant c (> 1) bounding the loss of negative-advantage tokens at c*|A|. None = off."""
    correction: Literal["none", "tis", "mis"] = "none"
    """Off-policy correction: none (PPO against the sampler), tis (truncated IS), mis (masked IS); tis / mis clip
    against pi_prox (decoupled PPO). Why none: docs/LEARNER.md "Choosing the defaults"."""
    tis_cap: float = Field(2.0, gt=0)
    """TIS truncation C of w = pi_prox / pi_behav."""
    mis_low: float = Field(0.5, gt=0)
    """MIS: tokens with w < mis_low are masked."""
    mis_high: float = Field(5.0, gt=0)
    """MIS: tokens with w > mis_high are masked."""
    nsr: Literal["off", "band", "noise"] = "off"
    """Near-boundary stochastic rescue: off, band (Bernoulli p in a band past the bound), noise
    (multiplicative uniform noise on the ratio; rescued if it lands back inside)."""
    nsr_band: float = Field(0.1, gt=0)
    """m: band width relative to the bound, (1+eps_high, (1+eps_high)(1+m)]."""
    nsr_prob: float = Field(0.5, ge=0, le=1)
    """p: rescue probability inside the band."""
    nsr_decay: bool = False
    """Let p fall linearly from nsr_prob at the bound to 0 at the band's far edge."""
    nsr_noise: float = Field(0.2, gt=0, lt=1)
    """delta of the noise mode: xi ~ U(1 - delta, 1 + delta)."""
    kl_beta: float = Field(0.0, ge=0)
    """KL (k3) coefficient to the starting policy (policy.path), frozen by the learner (one more forward per batch and
    one more copy of the weights). 0 = no term, no reference (the SimpleVLA-RL recipe)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How token losses become one scalar (token_mean = DAPO)."""
    adv_norm: Literal["group", "batch", "none"] = "group"
    """Advantage normalisation: group ((r - mean_g) / (std_g + eps), unbiased std), batch (the same over the
    whole batch), or none (the raw, reward-clipped rewards: no centring, adv_std ignored)."""
    adv_std: bool = True
    """Divide by the std (False = Dr.GRPO mean-only)."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""
    reward_clip: Optional[float] = Field(None, gt=0)
    """Clip rewards to +-reward_clip before normalisation. None = off."""
    advantage_clip: Optional[float] = Field(None, gt=0)
    """Clip advantages to +-advantage_clip. None = off."""
    outcomes: Literal["real", "shuffled"] = "real"
    """shuffled: the noise-only control. Each group's (success, reward) pairs are shuffled among its members before
    the advantages (seeded by run.seed), so the run keeps its own rollouts, schedule and batch sizes but loses the
    link between a trajectory's actions and its outcome: what a real run gains over it is what the rewards taught.
    Only the loss sees the shuffle; the success curves (buffer, actors, evals) are the real ones (docs/LIBERO.md
    "The noise-only control")."""

    @model_validator(mode="after")
    def _check_mis(self) -> "LossConfig":
        if self.mis_low >= self.mis_high:
            raise ValueError(f"mis_low ({self.mis_low}) must be below mis_high ({self.mis_high})")
        return self


class WeightsConfig(Section):
    fetch: bool = False
    """Actors mirror the learner's newest export from the buffer's weights file server into their own <run>/weights at
    start and after missed broadcasts: for actors without the learner's run directory (set by Ray and Slurm
    launchers)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Weight broadcast group: auto, gloo, nccl. auto = nccl on GPU when every member has a GPU of its own on this host,
    else gloo (NCCL refuses two ranks on one device; nccl on a shared GPU is refused before the run starts)."""
    bucket_mb: float = Field(16.0, gt=0)
    """Size cap of one broadcast bucket in MiB (the default is what gloo over loopback measured best at; NCCL is
    content with larger: docs/WEIGHTS.md)."""
    timeout_s: float = Field(30.0, gt=0)
    """A broadcast that takes longer (a dead or late actor) is abandoned and the group re-formed."""
    publish_every: int = Field(1, ge=1)
    """Broadcast weights every this many versions (at most buffer.max_staleness + 1, or actors would hold
    weights too old for any grant while the learner waits for their data)."""
    join_timeout_s: float = Field(3.0, gt=0)
    """How long the learner waits for invited actors to join a new broadcast group (epoch); an actor
    that misses it is left out, with back-off, and catches up from the exported file."""
    heartbeat_s: float = Field(0.5, gt=0)
    """Actor heartbeat into the weight store; an actor silent for 5x this is left out of the next group."""
    verify: bool = True
    """The learner computes each version's checksum while packing and receivers check it before taking it. False: no
    checksum on the broadcast path (exports still record one); `confirmed` then counts receipts."""
    verify_ranks: bool = False
    """After each publish every learner rank gathers the full weights and compares checksums with rank 0's broadcast
    (weights/rank_checksum_ok). One extra ZeRO-3 gather per version: for tests and debugging."""
    export: bool = True
    """Also write every version to <run>/weights/v<version>.safetensors + `latest` (what a restarted actor loads and the
    evaluator scores). False: restarted actors wait for the next broadcast; bin/train evaluates only <run>/policy."""
    export_keep: int = Field(2, ge=1)
    """Exported versions kept on disk (older ones are deleted)."""
    export_async: bool = True
    """Write the export in a background thread so the learner does not wait for the disk."""
    overlap: bool = True
    """Issue all bucket broadcasts before waiting (they overlap); False waits for each in turn (the naive
    loop, kept as a benchmark baseline)."""


class TransportConfig(Section):
    host: str = "127.0.0.1"
    """Interface the buffer and learner bind to (loopback by default; 0.0.0.0 for remote actors, which then
    requires transport.curve)."""
    connect_host: str = "127.0.0.1"
    """Host actors and learner ranks connect to."""
    trajectory_port: int = Field(5555, ge=0, le=65535)
    """Buffer PULL port for trajectories (0 = pick a free port)."""
    control_port: int = Field(5556, ge=0, le=65535)
    """Buffer ROUTER port for grants, heartbeats, stats and commands (0 = pick a free port)."""
    batch_port: int = Field(5559, ge=0, le=65535)
    """Buffer ROUTER port on which learner ranks ask for and receive their batches (0 = pick a free port). A socket
    and ZeroMQ I/O thread of its own: sending a batch of hundreds of MB never delays a grant on control_port."""
    weights_port: int = Field(5557, ge=0, le=65535)
    """Learner rank 0's TCPStore port: rendezvous of the weight-broadcast group (0 = a free port, which actors
    read from <run>/weights/endpoint.json)."""
    weights_fetch_port: Optional[int] = Field(None, ge=0, le=65535)
    """Port on which bin/buffer serves the learner's newest weights export in chunks to actors with
    weights.fetch (None = not served; 0 = pick a free port)."""
    use_ipc: bool = False
    """Use ipc:// sockets in the run directory instead of tcp:// (single host only)."""
    hwm: int = Field(64, ge=1)
    """ZeroMQ high-water mark in messages (back-pressure on actors): what an actor's trajectory socket queues."""
    trajectory_hwm: int = Field(4, ge=1)
    """Trajectories the buffer's socket queues per actor connection before it stops reading it. Bounds the buffer:
    about buffer.max_bytes + connections x (trajectory_hwm + 1) x transport.max_message_mb (docs/ARCHITECTURE.md)."""
    max_message_mb: float = Field(64.0, gt=0)
    """Receiving sockets drop any frame above this size before allocating it, and refuse any message whose frames
    add up to more (counted "oversize"). A frame below it is allocated whole when its header arrives, however
    slowly its bytes follow, so the buffer's memory bound counts this size per queued or half-read message: set
    it near one trajectory (the config check names the least) to keep that bound tight."""
    curve: bool = False
    """Require ZeroMQ CURVE authentication + encryption (required when transport.host is not loopback)."""
    curve_dir: Optional[str] = None
    """Directory with server.key(_secret) and client.key(_secret) written by bin/keys."""
    learner_secret_file: Optional[str] = None
    """The learner's credential for signing batch requests. None = <run_dir>/secrets/learner, created mode 0600 by
    whichever of buffer and learner starts first (the Ray launcher sets it for ranks without the run directory)."""
    actor_secret_file: Optional[str] = None
    """The actors' credential (each actor's messages carry a token derived from it and its id). None =
    <run_dir>/secrets/actors, mode 0600; the Ray and Slurm launchers set it for actors without the run directory."""
    weights_allowed_peers: List[str] = []
    """Addresses or CIDR networks (e.g. 10.0.0.0/24) allowed to reach the learner's weight store when transport.host is
    beyond loopback (required then: the store has no authentication). Loopback peers are always allowed."""


class PlacementConfig(Section):
    gpus_learner: Optional[list[int]] = None
    """GPU indices (as this host numbers them) of the learner ranks in rank order (length = learner.num_ranks), handed
    to the learner as CUDA_VISIBLE_DEVICES. None = leave the devices alone (rank r uses cuda:r)."""
    gpus_actors: Optional[list[int]] = None
    """GPU indices the actors are spread over: actor i gets gpus_actors[i % len] as its only visible device. None =
    every actor sees every GPU and uses cuda:0."""
    gpu_evaluator: Optional[int] = Field(None, ge=0)
    """GPU index of bin/train's evaluator (it runs in the launcher process). None = cuda:0."""

    @model_validator(mode="after")
    def _check_indices(self) -> "PlacementConfig":
        for name in ("gpus_learner", "gpus_actors"):
            ids = getattr(self, name)
            if ids is not None and (not ids or min(ids) < 0):
                raise ValueError(f"placement.{name} must be a non-empty list of GPU indices >= 0, got {ids}")
        if self.gpus_learner is not None and len(set(self.gpus_learner)) != len(self.gpus_learner):
            raise ValueError(f"placement.gpus_learner {self.gpus_learner} names a GPU twice: NCCL cannot run two ranks "
                             "on one device; give each rank its own GPU")
        return self


class RayConfig(Section):
    """Placement on a Ray cluster (run.launcher=ray): buffer and learner (rank 0 with per_rank) on the driver's node,
    actor fleets (and other ranks) wherever their resources are, each with a node-local directory."""

    address: str = "auto"
    """Cluster to join (ray.init address): auto = RAY_ADDRESS or the cluster this host belongs to (ray start);
    HOST:PORT = that cluster's head. bin/train never starts a cluster of its own."""
    fleets: int = Field(1, ge=1)
    """Actor fleets (one Ray actor each, running actor.num_actors actor processes; ids do not overlap)."""
    fleet_cpus: Optional[float] = Field(None, gt=0)
    """CPUs requested per fleet (None = actor.num_actors x actor.torch_threads)."""
    fleet_gpus: float = Field(0.0, ge=0)
    """GPUs requested per fleet."""
    fleet_memory_gb: Optional[float] = Field(None, gt=0)
    """Memory requested per fleet in GiB (None = no request; a LIBERO env worker's memory: docs/LIBERO.md)."""
    fleet_resources: Dict[str, float] = Field(default_factory=dict)
    """Custom resources per fleet, e.g. {actor_node: 1} to keep fleets on nodes started with
    ``ray start --resources '{"actor_node": 4}'``."""
    fleet_spread: bool = True
    """Place fleets with Ray's SPREAD strategy (one node's loss costs the fewest fleets)."""
    learner_placement: Literal["one_actor", "per_rank"] = "one_actor"
    """one_actor = one Ray actor on the driver's node starts all ranks (bin/learner --ranks N). per_rank = one Ray actor
    per rank (rank 0 on the driver's node), reserved together as a placement group, e.g. on other GPU nodes."""
    learner_cpus: float = Field(1.0, gt=0)
    """CPUs requested for the learner: for its one actor (all ranks) with learner_placement=one_actor, for each
    rank with per_rank."""
    learner_gpus: float = Field(0.0, ge=0)
    """GPUs requested for the learner: for its one actor (all ranks; set it to learner.num_ranks on a GPU node)
    with learner_placement=one_actor, for each rank (0 or 1) with per_rank."""
    learner_memory_gb: Optional[float] = Field(None, gt=0)
    """Memory requested for the learner in GiB, as learner_cpus (None = no request)."""
    learner_resources: Dict[str, float] = Field(default_factory=dict)
    """Custom resources for the learner, as learner_cpus, e.g. {learner_node: 1} with per_rank for one rank per node
    started with ``ray start --resources '{"learner_node": 1}'`` (the driver's node included)."""
    learner_master_port: int = Field(0, ge=0, le=65535)
    """With learner_placement=per_rank: the port of rank 0's rendezvous (MASTER_PORT) on the driver's node, which
    the other ranks' nodes must reach; 0 = a free one picked at start."""
    buffer_cpus: float = Field(1.0, gt=0)
    """CPUs requested for the buffer."""
    buffer_memory_gb: Optional[float] = Field(None, gt=0)
    """Memory requested for the buffer in GiB (None = buffer.max_bytes + 1 GiB for socket queues)."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts a dead buffer or fleet (error exit or lost node) before the run fails. The learner restarts
    only with learner_placement=per_rank (learner_restarts); otherwise its exit ends the run."""
    learner_restarts: int = Field(0, ge=0)
    """per_rank: times the whole rank group is placed anew and resumed from the latest checkpoint (or version 0) after a
    rank fails or its node is lost; needs the run directory on a filesystem all learner nodes share. Default 0, as
    torchrun's --max-restarts: a restart loses the updates since the last checkpoint, repeats deterministic failures."""

    @model_validator(mode="after")
    def _learner_per_rank(self) -> "RayConfig":
        if self.learner_placement == "per_rank" and self.learner_gpus not in (0, 1):
            # NCCL runs one rank per device, and a rank drives one device (LOCAL_RANK 0 of what Ray hands it).
            raise ValueError(f"ray.learner_gpus={self.learner_gpus} with ray.learner_placement=per_rank asks for "
                             "that many GPUs per rank, but a rank drives exactly one (and NCCL cannot put two "
                             "ranks on one GPU): set ray.learner_gpus=1 (or 0 for CPU ranks)")
        if self.learner_restarts and self.learner_placement != "per_rank":
            # One actor starts all ranks itself (bin/learner --ranks N); nothing would restart them: say so.
            raise ValueError(f"ray.learner_restarts={self.learner_restarts} restarts learner ranks placed one Ray "
                             "actor each: set ray.learner_placement=per_rank, or ray.learner_restarts=0")
        return self


class LoggingConfig(Section):
    tensorboard: bool = True
    """Write TensorBoard events to <run>/tb."""
    serve_tensorboard: bool = False
    """bin/train also starts a TensorBoard server."""
    tensorboard_host: str = "127.0.0.1"
    """Interface of the TensorBoard server (loopback by default)."""
    tensorboard_port: int = Field(6006, ge=0, le=65535)
    """Port of the TensorBoard server."""
    tensorboard_flush_s: int = Field(10, ge=1)
    """Seconds between flushes of buffered TensorBoard events to disk."""
    eval_videos: int = Field(2, ge=0)
    """Greedy eval episodes filmed per evaluation, written to TensorBoard as animated GIFs (eval/video/task<t>_init<i>);
    0 = off. Costs an image copy per env step of those episodes and a GIF encode per eval."""
    eval_video_fps: float = Field(8.0, gt=0)
    """Playback speed of the eval videos in frames per second, one frame per policy call (long episodes skip
    frames, same speed)."""
    status_every_s: float = Field(5.0, gt=0)
    """Seconds between live status lines."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""
