"""Tensor-parallel ranks (``--tensor-parallel N``): one replica over N processes.

Owns: starting the ranks and watching them (``launch.py``), the command protocol rank 0
drives the others with over ``torch.distributed`` (``channel.py``), what each rank holds of a
version (``shards.py``), a follower rank's loops (``follower.py``), and rank 0's side — the
scheduler's weights source and engine over every rank (``front.py``) and the store whose
publishes land on every rank or none (``store.py``). Imports ``model`` and ``snapshots``;
never the scheduler, the runtime or a transport (the server wires these parts in).
"""
