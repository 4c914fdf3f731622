"""The stand-in's text: a small fixed vocabulary (the harness builds the tokenizer over it,
loading this file by its path) and line ``i`` of the synthetic wikitext."""

WORDS = ("the", "of", "and", "in", "to", "a", "was", "is", "for", "on", "as", "by", "with",
         "he", "it", "that", "at", "from", "his", "an", "were", "are", "which", "this",
         "be", "or", "first", "also", "after", "new", "had", "one", "two", "their",
         "game", "season", "city", "river", "album", "war", "school", "film", "song",
         "team", "church", "league", "station", "series", "king", "party", "army")


def line(i: int) -> str:
    """Line ``i``: empty one time in five, else 6 to 40 words, and a newline."""
    if i % 5 == 4:
        return ""
    n = 6 + (i * 7919) % 35
    return " ".join(WORDS[(i * 31 + j * 17 + (i * j) % 13) % len(WORDS)] for j in range(n)) + "\n"
