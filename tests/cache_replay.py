"""What the TeaCache and MagCache conformance tests check of a replayed reference run."""


def assert_reference_decisions(run: dict, skipped: list, blocks_ran: int) -> None:
    """Our skipped calls are the reference's ([step, branch] each), and a skipped call ran no
    block. With cfg 1 we make the conditional calls only; the reference's conditional
    decisions stand (it runs both branches always)."""
    expected = [s for s in run["skipped"] if run["cfg"] != 1 or s[1] == 0]
    assert skipped == expected and len(expected) > 0
    calls = run["steps"] * (1 if run["cfg"] == 1 else 2)
    assert blocks_ran == calls - len(skipped)
