"""Where each rank sits and how ranks talk.

* :mod:`.layout` rank <-> (tp, cp, dp, pp) arithmetic and the layout check, torch-free
* :mod:`.state`  :class:`~hybrid.parallel.state.ParallelState`: sizes, ranks, groups, device
* :mod:`.comm`   the one door for collectives: counted bytes, timeouts, named errors
* :mod:`.agree`  agreeing on a rank-local value (an error, a maximum) over the world
* :mod:`.teardown` the end of a process: in-flight work finished, groups destroyed

Import from the modules: this package's ``__init__`` stays empty so that the
torch-free configuration can use :mod:`.layout` without importing torch.
"""
