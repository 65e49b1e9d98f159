"""The testbed: a scenario's cluster emulated on this machine, for the reference runtime to run in.

Each host of the topology becomes a network namespace; its ranks enter it
(:func:`enter_namespace`, before creating threads or sockets) and talk over ``eth0``
(``GLOO_SOCKET_IFNAME=eth0``) to other hosts and over ``lo`` among themselves. Links are shaped
with tbf; where the scenario has delays over 0.2 ms they are added by a user-space forwarder,
since this kernel has no netem, and otherwise the hosts' veths meet on a bridge. Usage::

    testbed = Testbed(scenario.name, build_topology(scenario.config.cluster))
    testbed.up()          # TestbedError if already up, not root, ...
    ...                   # fork ranks; rank r: enter_namespace(testbed.namespace_of_rank(r))
    testbed.down()        # also cleans up after a crashed up()

Measured on this machine (2 cores), 2 hosts x 2 devices, python sockets inside the namespaces;
TCP ping-pong RTT median of 50, rate median of 5 transfers of 10 MB (first to last byte); the
ranges span 3 runs:

=================  ==============  ==============  =============  =============
configured link    RTT configured  RTT measured    rate / config  forwarder CPU
=================  ==============  ==============  =============  =============
100 Mbit/s, 0.5ms  2.01 ms         2.36-2.42 ms    0.994-0.996    12% of a core
100 Mbit/s, 5 ms   20.01 ms        20.54-20.71 ms  0.993-0.995    7-8%
200 Mbit/s, 0.5ms  2.01 ms         2.33-2.38 ms    0.995          16-19%
200 Mbit/s, 5 ms   20.01 ms        20.55-20.73 ms  0.982-0.995    15-17%
100 Mbit/s, 50us   0.20 ms         0.10-0.13 ms    0.959-0.993    no forwarder
=================  ==============  ==============  =============  =============

The last row is a bridge (no delay injected; 50 pings, 10 MB transfers).

The delay is never short: wake-up latency (0.1-0.2 ms per sleep on this VM, in the forwarder and
in the receiving process) adds 0.16-0.36 ms per direction. At 25 ms per NIC (RTT 100.6 ms
measured), 40 MB transfers reached 0.99 of 100 and of 200 Mbit/s without drops. Two senders into one 100 Mbit/s
downlink got 47 and 54 Mbit/s. ``lo`` shaped to 800 Mbit/s gave 794-800 Mbit/s. gloo (torch
2.13) runs over it with ``GLOO_SOCKET_IFNAME=eth0``. ``up`` takes 0.15-0.2 s for 2 hosts and
0.3 s for 8, ``down`` about 0.03 s.

See :mod:`runtime.testbed.links` for how rates and delays derive from the topology and where
that is approximate (deeper trees, shared links, a NIC per device).
"""

from runtime.testbed.cluster import Testbed
from runtime.testbed.errors import TestbedError
from runtime.testbed.links import HostLinks
from runtime.testbed.netns import enter_namespace, require_privileges

__all__ = ["HostLinks", "Testbed", "TestbedError", "enter_namespace", "require_privileges"]
