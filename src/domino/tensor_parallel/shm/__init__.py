"""A shared-memory transport for the collectives of CPU ranks that share one host.

gloo moves every byte between two processes of one host through loopback TCP: each rank's
worker thread copies into the kernel, the kernel copies to the peer, and the sums run on top.
That costs CPU the ranks' compute needs on a host whose cores the ranks fill: overlapping the
transfer then cannot hide it. Through one shared mapping the same all-reduce is one copy in, a
sum of this rank's 1/N segment and one copy out, a fraction of gloo's wall time and CPU (the
figures: docs/benchmark.md, "The shared-memory transport").

How one collective runs (every rank of the group runs the same steps, in launch order, on its
own worker thread):

- each rank copies its input into its own slot of the mapping;
- a barrier;
- all-reduce: rank r sums segment r of every slot, in rank order, and publishes the sum in its
  own slot; after a second barrier every rank copies every other segment from its owner's slot
  (two ranks: each sums the whole tensor, its own and the peer's slot, and is done: fewer
  copies, one barrier);
- reduce-scatter: each rank copies in only the chunks the others sum; rank r sums chunk r of
  every slot and its own, in rank order, into its output;
- all-gather: every rank copies every slot into its output;
- all-to-all (uneven splits): the ranks first all-gather their split sizes (so every rank knows
  where each peer's chunks lie, how many pieces there are, and that the sizes agree); each rank
  copies its own chunk straight to its output, and into its slot only what it sends the others;
  every rank then reads its chunk from each peer's slot.

Sums run in rank order on one rank, so every rank gets the same bits, and a reduce-scatter the
bits of the pairwise gloo exchange it replaces. Two sets of slots alternate, so a rank may run
one collective ahead of the slowest without overwriting what that one still reads; tensors
larger than a slot go through in pieces. A barrier is one byte written to a FIFO per peer and
one read from each: a waiting rank sleeps in the kernel and takes no CPU. A peer that exits
closes its FIFOs, so the others see end-of-file and fail at once; a peer that stops taking
part makes them fail after the process group's timeout.

The files (one mapping, the FIFOs) live in a fresh private directory under /dev/shm that is
removed as soon as every rank has opened them, so a crash later leaves nothing behind; one
during set-up can, and the next set-up removes directories whose creating process is gone.
:func:`open_transport` decides on every rank alike whether the transport can be used (one
host: same boot, same network namespace, same /dev/shm; the files could be created, sized and
opened) and returns None everywhere otherwise, so the group keeps to gloo.

Modules: :mod:`.setup` (the agreement and the files), :mod:`.channel` (one rank's end: the
mapping's slots and the FIFO barrier), :mod:`.ops` (the algorithms above, over a channel),
:mod:`.transport` (the worker thread and the calls CommGroup makes).
"""

from domino.tensor_parallel.shm.setup import SLOT_BYTES, host_key, open_transport
from domino.tensor_parallel.shm.transport import SharedMemoryTransport

__all__ = ["SLOT_BYTES", "SharedMemoryTransport", "host_key", "open_transport"]
