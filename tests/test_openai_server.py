"""The fake OpenAI server used by the tests keeps the test output clean."""

from __future__ import annotations

import pytest

from tests.kit.openai_server import OpenAIServer, _QuietServer


def test_the_fake_openai_server_is_quiet_about_clients_that_hang_up(capsys: pytest.CaptureFixture[str]) -> None:
    with OpenAIServer() as server:
        httpd = server._httpd
        assert isinstance(httpd, _QuietServer)
        for expected in (BrokenPipeError(), ConnectionResetError(), TimeoutError()):
            try:
                raise expected
            except OSError:
                httpd.handle_error(None, ("127.0.0.1", 1))
        assert "Exception occurred" not in capsys.readouterr().err
        try:
            raise ValueError("a real bug")
        except ValueError:
            httpd.handle_error(None, ("127.0.0.1", 1))
        assert "Exception occurred" in capsys.readouterr().err
