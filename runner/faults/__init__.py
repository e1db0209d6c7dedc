"""Fault injection against a live local system (bin/chaos, tests/faults): ``live`` (the system whose parts are
killed and restarted), ``fuzz`` (hostile frames and forged control messages), ``chaos`` (the scenarios) and
``audit`` (each trajectory's fate, from the buffer's recordings)."""
