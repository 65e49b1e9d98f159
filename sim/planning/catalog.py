"""The priced catalog the planner shops from: device offers, host interconnects, networks, storage.

The shipped default (``sim/planning/catalog.yaml``) gives each price its source and date: cloud
on-demand list prices per device-hour, and owned devices as list price over three years plus
power. A device's offer also prices the **host** that carries it, per host: 0 where the device's
price already includes it (a cloud instance, a Jetson developer kit), else the PC an owner buys
for it (its CPU, board, memory, power supply, case and drive over three years, plus its own
power). A plan file may name another catalog file (``catalog:``) or override single prices
(``prices: {rtx_4090: 0.29}``, ``host_prices: {rtx_4090: 0.1}``). Prices are US dollars per
hour; every link is parsed by :mod:`sim.units` into SI (bytes/s, s), as a scenario's links are.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from models.errors import ConfigError, shorten
from models.input_files import load_yaml
from sim.cluster_config import LinkConfig
from sim.devices import DEVICES

DEFAULT_CATALOG = Path(__file__).with_name("catalog.yaml")
MAX_PRICE_PER_HOUR = 1e6  # dollars; a device-hour beyond a million is a typo
_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
_PRICE = Field(ge=0, le=MAX_PRICE_PER_HOUR)


class DeviceOffer(BaseModel):
    """One device type for sale or rent: ``price_per_hour`` ($/h per device), at most
    ``max_per_host`` per host, joined inside a host by one of ``interconnects`` (names of the
    catalog's interconnects; none: one per host); ``host_price_per_hour``: the host carrying
    them ($/h per host, whatever its devices; 0 where ``price_per_hour`` includes it), sourced
    by ``host_source``."""

    model_config = _STRICT
    price_per_hour: float = _PRICE
    max_per_host: StrictInt = Field(default=1, ge=1, le=1024)
    interconnects: list[str] = Field(default_factory=list, max_length=16)
    source: str = Field(default="", max_length=1000)
    as_of: str = Field(default="", max_length=40)
    host_price_per_hour: float = Field(default=0.0, ge=0, le=MAX_PRICE_PER_HOUR)
    host_source: str = Field(default="", max_length=1000)


class Interconnect(LinkConfig):
    """A link from each device to its host's bus, priced per device ($/h)."""

    price_per_hour_per_device: float = Field(default=0.0, ge=0, le=MAX_PRICE_PER_HOUR)
    source: str = Field(default="", max_length=1000)


class Network(LinkConfig):
    """A network between hosts: one NIC per host, or per device (``nic_per_device``), priced per
    host and per device ($/h); ``devices``: the device types it serves (empty: all)."""

    nic_per_device: StrictBool = False
    price_per_hour_per_host: float = Field(default=0.0, ge=0, le=MAX_PRICE_PER_HOUR)
    price_per_hour_per_device: float = Field(default=0.0, ge=0, le=MAX_PRICE_PER_HOUR)
    devices: list[str] = Field(default_factory=list, max_length=64)
    source: str = Field(default="", max_length=1000)

    def serves(self, device_type: str) -> bool:
        return not self.devices or device_type in self.devices


class Catalog(BaseModel):
    """A whole catalog (see the module docstring); every name it uses must be defined in it."""

    model_config = _STRICT
    as_of: str = Field(default="", max_length=40)
    currency: str = Field(default="USD", max_length=10)
    devices: dict[str, DeviceOffer] = Field(min_length=1, max_length=256)
    interconnects: dict[str, Interconnect] = Field(default_factory=dict, max_length=64)
    networks: dict[str, Network] = Field(default_factory=dict, max_length=64)
    storage: LinkConfig | None = None

    @model_validator(mode="after")
    def _names_resolve(self) -> Catalog:
        for name, offer in self.devices.items():
            if name not in DEVICES:
                raise ConfigError(f"devices.{name}", f"unknown device; known: {', '.join(DEVICES)} (got {shorten(name)})")
            for link in offer.interconnects:
                if link not in self.interconnects:
                    raise ConfigError(f"devices.{name}.interconnects", f"not an interconnect of the catalog; "
                                                                       f"known: {', '.join(self.interconnects)} "
                                                                       f"(got {shorten(link)})")
        for name, network in self.networks.items():
            for device in network.devices:
                if device not in DEVICES:
                    raise ConfigError(f"networks.{name}.devices", f"unknown device; known: {', '.join(DEVICES)} "
                                                                   f"(got {shorten(device)})")
        return self

    def with_prices(self, prices: dict[str, float], host_prices: dict[str, float] | None = None) -> Catalog:
        """The catalog with the device prices of ``prices`` and the host prices of
        ``host_prices`` ($/h, by device name) replacing its own.

        Raises:
            ConfigError: on ``prices.<name>`` or ``host_prices.<name>``, a device the catalog does
                not offer.
        """
        devices = dict(self.devices)
        for field, given, price_key, source_key in (("prices", prices, "price_per_hour", "source"),
                                                    ("host_prices", host_prices or {}, "host_price_per_hour",
                                                     "host_source")):
            for name, price in given.items():
                if name not in devices:
                    raise ConfigError(f"{field}.{name}", f"not a device of the catalog; offered: "
                                                         f"{', '.join(devices)} (got {shorten(name)})")
                update = {price_key: price, source_key: f"PLAN.yaml {field}"}
                devices[name] = devices[name].model_copy(update=update | ({"as_of": ""} if field == "prices" else {}))
        return self.model_copy(update={"devices": devices})


def price_text(price_per_hour: float) -> str:
    """A price per hour for people, without the currency: cents where they matter (``0.041``,
    ``0.34``), two decimals from a dollar up (``2.72``, ``23.92``), so that two owned GPUs a fifth
    of a cent apart do not both read 0.04."""
    return f"{price_per_hour:.2f}" if abs(price_per_hour) >= 1 else f"{price_per_hour:.2g}"


def load_catalog(path: Path = DEFAULT_CATALOG, field: str = "catalog") -> Catalog:
    """Read and validate a catalog YAML file.

    Raises:
        ConfigError: a missing or malformed file, or any invalid entry, naming ``field`` and the entry.
    """
    from sim.scenario import validate_document

    if not path.is_file():
        raise ConfigError(field, f"no such file (got {shorten(str(path), keep_end=True)})")
    try:
        return validate_document(Catalog, load_yaml(path, field), field)
    except ConfigError as error:
        raise ConfigError(f"{path.name}: {error.field}", error.message) from None
