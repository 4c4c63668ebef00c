"""A tiny authoritative DNS server for tests (run inside a test network namespace): names starting with
`fast` are answered at once (A 1.2.3.4, AAAA 2001:4860::1), every other name is never
answered; each query received is appended to a log file as one line `<type> <name>`.

    python -m tests.support.dns_upstream --listen 10.98.21.2 --log FILE
"""

from __future__ import annotations

import argparse
import socket

import dns.message
import dns.rdatatype
import dns.rrset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((args.listen, 53))
    with open(args.log, "a", buffering=1) as log:
        while True:
            wire, peer = sock.recvfrom(4096)
            try:
                query = dns.message.from_wire(wire)
            except Exception:
                continue
            question = query.question[0]
            name = question.name.to_text(omit_final_dot=True)
            log.write(f"{dns.rdatatype.to_text(question.rdtype)} {name}\n")
            if not name.startswith("fast"):
                continue  # a hung upstream: never answered
            response = dns.message.make_response(query)
            if question.rdtype == dns.rdatatype.A:
                response.answer.append(dns.rrset.from_text(question.name, 30, "IN", "A", "1.2.3.4"))
            elif question.rdtype == dns.rdatatype.AAAA:
                response.answer.append(dns.rrset.from_text(question.name, 30, "IN", "AAAA", "2001:4860::1"))
            sock.sendto(response.to_wire(), peer)


if __name__ == "__main__":
    main()
