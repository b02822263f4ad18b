from tests.security.test_network import *  # noqa
async def test_scratch(stack, netprobe_bin):
    plain = await with_probe(await stack.create(), netprobe_bin)
    print(await sh(plain, "ping -c1 -W1 127.0.0.1; cat /proc/sys/net/ipv4/ping_group_range; id; cat /proc/self/status | grep -i cap"))
    n = await with_probe(await stack.create(network={"allow_out": ["198.51.100.0/24"]}), netprobe_bin)
    print(await sh(n, "ping -c1 -W1 127.0.0.1; cat /proc/sys/net/ipv4/ping_group_range; id; cat /proc/self/status | grep -i cap"))
