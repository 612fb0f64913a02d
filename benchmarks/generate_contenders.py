"""What a bench_generate run is made of: the contender names and what each runs, prompt lengths
("64k") and card labels ("card24")."""

from __future__ import annotations

from typing import Any


def parse_tokens(s: str) -> int:
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def card_label(card: str) -> str:
    from reviva import parse_bytes

    n = parse_bytes(card)
    if n % 10**9 == 0:
        return f"card{n // 10**9}"
    return "card" + "".join(ch for ch in card if ch.isalnum())


def split_list(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


# reviva_paged's page: 8192 tokens (32 MiB of the 8B shape's K/V per layer, an eighth of a 64k
# layer): large enough that a step's page acquires and merges cost the host little.
PAGE_TOKENS = 8192


def contender_spec(name: str, card: str | None) -> dict[str, Any]:
    """What a contender name runs; ValueError naming it when unknown or meaningless here."""
    if name in ("hf", "hf_offload"):
        return {"kind": name}
    if name == "reviva_default":
        return {"kind": "reviva", "vram_budget": None}
    if name == "reviva":
        if card is None:
            raise ValueError(
                "contender 'reviva' means RevivaConfig(vram_budget=<card>): it has no meaning "
                "without a card; use reviva_default or reviva=<bytes> among --no-card-contenders"
            )
        return {"kind": "reviva", "vram_budget": card}
    if name == "reviva_default_fp8":  # issue 38: fp8 K/V on the whole card
        return {"kind": "reviva", "vram_budget": None, "kv_dtype": "fp8"}
    if name == "reviva_fp8":  # issue 13: fp8 K/V (Note [fp8 K/V rows]) on the card
        if card is None:
            raise ValueError("contender 'reviva_fp8' runs on the card: use it in --contenders")
        return {"kind": "reviva", "vram_budget": card, "kv_dtype": "fp8"}
    if name == "reviva_paged" or name.startswith("reviva_paged="):  # Note [Paged layers]
        if card is None:
            raise ValueError(f"contender {name!r} runs on the card: use it in --contenders")
        page = name.split("=", 1)[1] if "=" in name else str(PAGE_TOKENS)
        if not page.isdigit() or int(page) <= 0:
            raise ValueError(f"contender {name!r}: the page must be a number of tokens > 0")
        return {"kind": "reviva", "vram_budget": card, "kv_page_tokens": int(page)}
    if name in ("reviva_flash", "reviva_cudnn"):  # Note [Prefill attention kernel], forced
        if card is None:
            raise ValueError(f"contender {name!r} runs on the card: use it in --contenders")
        return {"kind": "reviva", "vram_budget": card, "attention_kernel": name[len("reviva_") :]}
    if name.startswith("reviva="):
        from reviva import parse_bytes

        budget = name.split("=", 1)[1]
        parse_bytes(budget)  # ValueError naming it
        return {"kind": "reviva", "vram_budget": budget}
    raise ValueError(
        f"unknown contender {name!r}: use hf, hf_offload, reviva, reviva_fp8, reviva_flash, "
        "reviva_cudnn, reviva_paged, reviva_paged=<tokens>, reviva_default, reviva_default_fp8 "
        "or reviva=<bytes>"
    )
