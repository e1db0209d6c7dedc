"""async_vla: asynchronous actor-learner RL for vision-language-action policies (library code only)."""

__version__ = "0.1.0"
