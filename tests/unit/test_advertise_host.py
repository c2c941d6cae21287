"""The address a replica advertises in the membership (``--advertise-host``): the given host,
else the bind address when it is a specific one, else the hostname — never 0.0.0.0 or ::."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from oldlogit_service.cli import main
from oldlogit_service.cluster.replicas import advertised_address
from oldlogit_service.config import Settings, is_wildcard


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", ""])
def test_a_wildcard_bind_advertises_the_hostname(bind: str) -> None:
    assert is_wildcard(bind)
    assert advertised_address(bind, 8000) == f"{socket.gethostname()}:8000"


@pytest.mark.parametrize(
    ("bind", "expected"),
    [
        ("127.0.0.1", "127.0.0.1:8000"),
        ("10.1.2.3", "10.1.2.3:8000"),
        ("localhost", "localhost:8000"),
        ("::1", "[::1]:8000"),
        ("[fd00::5]", "[fd00::5]:8000"),
    ],
)
def test_a_specific_bind_address_is_advertised_as_it_is(bind: str, expected: str) -> None:
    assert not is_wildcard(bind)
    assert advertised_address(bind, 8000) == expected


@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1"])
def test_the_advertise_host_wins(bind: str) -> None:
    assert advertised_address(bind, 50051, "oldlogit-1") == "oldlogit-1:50051"
    assert advertised_address(bind, 50051, "fd00::7") == "[fd00::7]:50051"  # a pod IP (IPv6)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_advertise_host_is_refused_at_start_up(
    host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValidationError, match="no address a client can reach"):
        Settings(demo=True, advertise_host=host)
    assert main(["serve", "--demo", "--advertise-host", host]) == 2
    assert "--advertise-host" in capsys.readouterr().err


def test_the_setting_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLDLOGIT_ADVERTISE_HOST", "10.0.0.7")  # Kubernetes: the pod IP
    assert Settings(demo=True).advertise_host == "10.0.0.7"
