"""bitsandbytes' optimizers' thresholds, which both the textbook's state (memcalc.memory.state) and the replay
(memcalc.exact.train.optimizers) follow. Source: bitsandbytes optim/optimizer.py Optimizer2State.init_state and
Optimizer8bit.get_state_buffer."""

MIN_8BIT_SIZE = 4096  # Optimizer2State: tensors with fewer elements keep fp32 state
MIN_PAGED_SIZE = 100_000  # Optimizer8bit.get_state_buffer: paged only when p.numel() >= 1e5
BLOCK = 256  # Optimizer2State.init_state: elements per absmax
