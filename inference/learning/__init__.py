"""Online learning in the worker: labels and gradients of the two-tower model (``steps``), the
local step on the cached rows (``learner``), read-your-writes bookkeeping (``pending``), the
gradient outbox and its sender, broadcast rows installed (``updates``), admission."""
