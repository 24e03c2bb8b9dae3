"""The proxy's index of one prefill's cached blocks: what it matches after any order of announcements (orphans
indexed once their parent is), and what a bound forgets (leaves, least recently announced first; never a live
chain's root)."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from deploy.services.kv_events import BlockRemoved, BlockStored
from deploy.services.prefix_index import PrefixIndex, iter_keys

BS = 4


def chain(start, n, parent=None, first_hash=0):
    """A BlockStored of `n` blocks whose tokens are start, start+1, ... and whose hashes name them (vLLM's hashes
    follow the tokens; here a block's name is its tokens' first value)."""
    tokens = list(range(start, start + n * BS))
    return BlockStored([b"h%d" % t for t in tokens[::BS]], parent, tokens, BS, medium="GPU")


def matched(index, tokens):
    return index.matched_blocks(iter_keys(tokens, BS))


PROMPT = list(range(0, 12 * BS))


@pytest.mark.unit
def test_a_block_whose_parent_is_unknown_waits_and_is_indexed_with_it():
    """Blocks 4-5 arrive before blocks 0-3 (a replay that begins after them, a gap): they match once 0-3 do, as a
    full report sends them, from the first block."""
    index = PrefixIndex(max_blocks=100)
    index.store(chain(4 * BS, 2, parent=b"h%d" % (3 * BS)))
    assert matched(index, PROMPT) == 0 and index.orphans == 2 and len(index) == 0
    assert not index.holds_a_first_block
    index.store(chain(0, 4))
    assert matched(index, PROMPT) == 6 and index.orphans == 0 and len(index) == 6
    assert index.holds_a_first_block


@pytest.mark.unit
def test_a_removed_orphan_is_not_indexed_later():
    index = PrefixIndex(max_blocks=100)
    index.store(chain(4 * BS, 2, parent=b"h%d" % (3 * BS)))
    index.remove(BlockRemoved([b"h%d" % (5 * BS)], medium="GPU"))
    index.store(chain(0, 4))
    assert matched(index, PROMPT) == 5 and index.orphans == 0


@pytest.mark.unit
def test_the_bound_forgets_leaves_and_never_a_live_chains_root():
    """A conversation's chain (blocks 0-7, stored turn by turn) and an idle prompt's single block: past the bound the
    idle leaf and the chain's tail go, the chain's first blocks stay (FIFO would have forgotten them first and left
    the rest unreachable)."""
    index = PrefixIndex(max_blocks=6)
    index.store(chain(0, 2))
    index.store(BlockStored([b"idle"], None, [99] * BS, BS, medium="GPU"))
    index.store(chain(2 * BS, 3, parent=b"h%d" % BS))  # 6 blocks: at the bound
    assert matched(index, PROMPT) == 5 and len(index) == 6
    index.store(chain(5 * BS, 1, parent=b"h%d" % (4 * BS)))  # one more: the least recent leaf goes (idle)
    assert matched(index, [99] * BS) == 0 and matched(index, PROMPT) == 6
    index.store(BlockStored([b"new"], None, [77] * BS, BS, medium="GPU"))  # the chain's tail goes, not its root
    assert matched(index, PROMPT) == 5 and matched(index, [77] * BS) == 1 and len(index) == 6


@pytest.mark.unit
def test_a_full_report_refreshes_a_chain():
    """A chain announced again (vLLM's full report of a cache hit) becomes the most recent: another chain's leaves
    go first."""
    index = PrefixIndex(max_blocks=4)
    index.store(chain(0, 2))
    index.store(BlockStored([b"x1", b"x2"], None, [50] * BS + [51] * BS, BS, medium="GPU"))
    index.store(chain(0, 2))  # a hit on blocks 0-1, reported again
    index.store(chain(2 * BS, 1, parent=b"h%d" % BS))
    assert matched(index, PROMPT) == 3 and matched(index, [50] * BS + [51] * BS) == 1


@pytest.mark.unit
def test_a_parent_chain_that_loops_still_ends_under_the_bound():
    index = PrefixIndex(max_blocks=1)
    index.store(BlockStored([b"a"], None, [1] * BS, BS, medium="GPU"))
    index.store(BlockStored([b"b"], b"a", [2] * BS, BS, medium="GPU"))
    index.store(BlockStored([b"a"], b"b", [3] * BS, BS, medium="GPU"))  # only a hostile publisher sends this
    assert len(index) <= 1


@pytest.mark.unit
def test_blocks_off_the_instances_own_cache_are_not_indexed():
    """A pool's or an offload tier's blocks (any medium but vLLM's own "GPU") are reachable from every prefill that
    reads them: they make no instance the place for a prompt."""
    index = PrefixIndex(max_blocks=8)
    assert index.store(BlockStored([b"p1"], None, PROMPT[:BS], BS, medium="STORAGE")) == "medium"
    assert index.store(BlockStored([b"c1"], None, PROMPT[:BS], BS, medium="CPU")) == "medium"
    assert index.store(BlockStored([b"l1"], None, PROMPT[:BS], BS, medium="GPU", extra_keys=[("lora",)])) \
        == "unindexable"
    assert len(index) == 0
    assert index.store(BlockStored([b"g1"], None, PROMPT[:BS], BS, medium="GPU")) is None
    assert matched(index, PROMPT) == 1
    assert index.store(BlockStored([b"g9"], None, [1] * 8, 8, medium="GPU")) == "block_size"


# -- any order of announcements matches what vLLM holds --------------------------------------------------------
def _tree(rng: random.Random, nodes: int) -> dict[int, int | None]:
    """A random prefix tree: node -> parent (node i's tokens are [i] * BS)."""
    return {i: (None if i == 0 or rng.random() < 0.2 else rng.randrange(i)) for i in range(nodes)}


def _path(tree, node):
    path = []
    while node is not None:
        path.append(node)
        node = tree[node]
    return path[::-1]


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nodes=st.integers(2, 40), steps=st.integers(1, 80))
def test_any_order_of_stores_and_removals_matches_the_held_blocks(seed, nodes, steps):
    """Blocks announced in any order (children before parents, as after a gap), removed and stored again: for every
    prompt, the index matches exactly the blocks a prefix cache holding the stored blocks would hit (a block hits
    when it and every block before it are held)."""
    rng = random.Random(seed)
    tree = _tree(rng, nodes)
    index, held = PrefixIndex(max_blocks=10_000), set()
    for _ in range(steps):
        node = rng.randrange(nodes)
        path = _path(tree, node)
        if rng.random() < 0.3:
            index.remove(BlockRemoved([b"n%d" % node], medium="GPU"))
            held.discard(node)
            continue
        segment = path[rng.randrange(len(path)):]  # a stored run of blocks, from any point of its chain
        parent = tree[segment[0]]
        index.store(BlockStored([b"n%d" % n for n in segment], None if parent is None else b"n%d" % parent,
                                [t for n in segment for t in [n] * BS], BS, medium="GPU"))
        held.update(segment)
    for node in range(nodes):
        path = _path(tree, node)
        expected = next((i for i, n in enumerate(path) if n not in held), len(path))
        assert matched(index, [t for n in path for t in [n] * BS]) == expected


@pytest.mark.unit
def test_the_keys_it_gave_named_blocks_stop_at_the_first_it_lacks():
    index = PrefixIndex(max_blocks=100)
    index.store(chain(0, 4))
    names = [("GPU", b"h%d" % (i * BS)) for i in range(6)]
    keys = list(iter_keys(PROMPT, BS))
    assert index.keys_of(names) == keys[:4]
    assert index.keys_of(names, 2) == keys[2:4]
    index.remove(BlockRemoved([b"h%d" % BS], medium="GPU"))
    assert index.keys_of(names) == keys[:1], "a block removed ends the run, its children indexed or not"


@pytest.mark.unit
def test_blocks_stored_with_their_keys_are_indexed_as_stored_ones():
    """`store_keyed` (the simulator's: blocks without tokens, keyed by chained hashes) does what `store` does: the
    same holders, leaves, orphans adopted with their own keys once the parent comes, removals."""
    by_tokens, by_keys = PrefixIndex(max_blocks=100), PrefixIndex(max_blocks=100)
    names = [b"h%d" % t for t in range(0, 6 * BS, BS)]
    keys = list(iter_keys(PROMPT[:6 * BS], BS))
    by_tokens.store(chain(4 * BS, 2, parent=names[3]))
    by_keys.store_keyed(names[4:6], names[3], keys[4:6], BS)
    assert by_keys.orphans == by_tokens.orphans == 2 and len(by_keys) == 0
    by_tokens.store(chain(0, 4))
    by_keys.store_keyed(names[:4], None, keys[:4], BS)
    assert matched(by_keys, PROMPT) == matched(by_tokens, PROMPT) == 6 and by_keys.orphans == 0
    assert by_keys.keys_of([("GPU", n) for n in names]) == by_tokens.keys_of([("GPU", n) for n in names]) == keys
    for index in (by_tokens, by_keys):
        index.remove(BlockRemoved([names[2]], medium="GPU"))
    assert matched(by_keys, PROMPT) == matched(by_tokens, PROMPT) == 2
