"""Prompts shared by the end-to-end tests."""

LONG = ("Rivers carve valleys over thousands of years, carrying sediment from mountains to the "
        "sea. Along the way they feed wetlands, shape deltas and support towns that grew up on "
        "their banks. ") * 14 + "In one sentence, the main idea of this text is"

COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Héllo wörld! Ça va? 日本語のテキストを",
    "Emoji test: 🦀🐍 are the mascots of",
    "1, 2, 3, 4, 5,",
    LONG,
]

CHATS = [
    "What is 2+2?",
    "Translate 'good morning' to Spanish.",
    "Écris une phrase en français sur la mer.",
    "List three colors.",
]
