"""The distributed engine behind ``bdsgd profile`` and ``bdsgd train``.

A parameter server (process id 0) and N workers (ids 1..N, trace worker w = id - 1) share a c10d
TCPStore for control and a gloo (CPU) process group for tensors. Every iteration:

1. the server asks the policy for c, announces the iteration in the store and sends the current
   parameters to every live worker;
2. each worker waits out its injected delay (a store wait that ends early when the iteration is
   cut), computes its gradient micro-batch by micro-batch, and takes a ticket from the iteration's
   atomic counter (``store.add``): tickets 1..c are admitted and send their gradient, ticket c
   sets the iteration's cut key, which makes every straggler abandon the iteration;
3. the server receives the c admitted gradients in ticket order, steps its optimizer, feeds the
   policy (stragglers censored at the c-th run-time) and moves on.

Workers append their own per-iteration record to a store key per batch of iterations; the server
turns those into schema-v1 trace rows off the critical path. A worker that dies poisons a gloo
context, so the server rebuilds the group among the survivors (a new "generation").

Asynchronous policies (``k-async:K``, ``async``, ``adasync``) run a second server/worker pair
(``async_server.py``, ``async_worker.py``, keys in ``async_protocol.py``): each worker computes
continuously, takes a ticket from one global arrival counter when its gradient is ready and sends
it over its own two-member gloo group; the server applies every K arrivals and sends fresh
parameters to those K senders only, so stragglers keep computing and land late (stale).
"""
