"""The group-assembling replay buffer: ``GroupBuffer`` (assembly, filters, the ready queue, batches), its
``Admission`` (the pacing and staleness rule), its ledger (every received trajectory ends in exactly one state),
``BufferService`` (the buffer process's sockets) and the recording / replay of what it received. Nothing here imports torch: the buffer process never loads it."""
from async_vla.buffer.group_buffer import GroupBuffer
from async_vla.buffer.ledger import STATES
from async_vla.buffer.service import BufferService

__all__ = ["STATES", "BufferService", "GroupBuffer"]
