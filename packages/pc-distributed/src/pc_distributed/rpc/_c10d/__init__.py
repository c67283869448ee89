r"""The c10d RPC engine: calls, replies and remote values over gloo process groups, never torch RPC.

One :class:`~.transport.C10dTransport` per process carries calls between the members of a World with nothing
but the public point-to-point ops of gloo process groups (``ProcessGroup.send``/``recv``); it never touches
``torch.distributed.rpc``. Each pair of members has a *link*, a gloo process group of its own two members
(:func:`pc_distributed._torch_dist.pair_link`). Requests ``(fn, args, kwargs)``, results and exceptions are
pickled by :mod:`~.codec`: by name where a name loads (as torch's RPC does), by value with pc-pickle where not
(lambdas, closures); large host tensor storages travel beside the pickle as *parts*, straight from and into
tensor memory; CUDA storages travel as parts through one pinned host copy each way (gloo's point-to-point ops
abort the process on a CUDA tensor, so only host tensors are ever handed to them:
:func:`~.frames.check_host_tensor`). :class:`C10dBackend` (``backend.py``) is the engine as the RPC layer's
backend ``"c10d"``.

Data flow (one process; ``~~`` is a link's point-to-point ops, ``>>`` a queue; the modules in brackets)::

    caller thread -- pickle [codec], pending[call id] [calls] -- post frame [frames] ~~send~~> peer's receiver
                                 ^                                                                       |
                                 | reply (value / error)                              the request runs (below)
    receiver threads for peer p [peer] <~~recv from p~~ frames of p <~~ reply posted by p's server ------'
         | request: the turn handed on, fn(*args, **kwargs) here (or >> [workers]), reply to the caller
         | into memory lent by [memory]; a remote call's value kept for its reference [kept]
    housekeeper: keep-alive pings, call deadlines, releases of garbage-collected remote references [ref]
    (it sleeps until the next keep-alive or the earliest deadline of a call still pending)

Modules: ``transport`` (the protocol: sends, the turn-taking receivers, serving requests, peer loss,
keep-alives and deadlines, the goodbye), ``calls`` (the calls in flight), ``peer`` (what it knows of each
other member), ``workers`` (its thread pool), ``kept`` (the values it keeps for others' remote references),
``ref`` (a reference to a remote value, and :class:`~.ref.RemoteValues`, what it needs of its creator's
transport), ``lane`` (the thread that sends to one peer), ``frames`` (the frames on a link), ``memory`` (the
memory frames are received into, and views of tensor memory), ``codec`` (how it pickles), ``backend``
(:class:`C10dBackend`).

Why ``transport`` stays one module: the protocol's state (the calls in flight, each peer's goodbye and loss,
the handlers running, the shutdown state) is guarded by one lock because every transition reads and changes
more than one part of it at once: a loss fails that peer's calls, a goodbye is ordered against the requests
already accepted from it, shutdown waits until calls and handlers are done. Each piece that owns its state
apart is a module of its own and takes no part in that lock; what is left is the one invariant, in one place.
"""

from pc_distributed.rpc._c10d.backend import C10dBackend

__all__ = ["C10dBackend"]
