"""Clients that keep asking a router while a test changes the instances behind it."""

from __future__ import annotations

import threading

import openai


class AskingClients:
    """``count`` threads, each sending the same chat request again as soon as it is answered,
    until ``stop``; every outcome is ``"ok"``, ``"short: N"`` (fewer tokens than asked) or
    ``"failed: ..."``."""

    def __init__(self, url: str, model: str, max_tokens: int, count: int = 4) -> None:
        self.model, self.max_tokens = model, max_tokens
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        self.outcomes: list[str] = []
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._ask) for _ in range(count)]

    def _ask(self) -> None:
        while not self.stop_event.is_set():
            try:
                answer = self.client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": "Tell me about rivers."}],
                    max_tokens=self.max_tokens,
                )
                got = answer.usage.completion_tokens if answer.usage else 0
                self.outcomes.append("ok" if got == self.max_tokens else f"short: {got}")
            except Exception as exc:
                self.outcomes.append(f"failed: {exc!r}")

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            if thread.is_alive():
                thread.join(timeout=120)

    @property
    def failed(self) -> list[str]:
        return [o for o in self.outcomes if o != "ok"]
