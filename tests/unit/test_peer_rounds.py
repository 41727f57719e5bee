"""Which fragment each round syncs, and how many outer steps each fragment has taken: a peer
that downloads round R must set each fragment's step count exactly as the peers that
applied rounds 1..R did (Nesterov's first step differs from the others)."""

from swarmloco.train.diloco import rounds_of_fragment


def test_step_counts_match_replaying_the_rounds():
    for fragments in (1, 2, 3, 5):
        counts = [0] * fragments
        for r in range(1, 40):
            counts[(r - 1) % fragments] += 1  # round r syncs fragment (r - 1) % F
            assert [rounds_of_fragment(r, f, fragments) for f in range(fragments)] == counts
        assert all(rounds_of_fragment(0, f, fragments) == 0 for f in range(fragments))
