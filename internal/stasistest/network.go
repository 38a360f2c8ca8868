package stasistest

import (
	"io"
	"net"
	"sync"
)

// Network joins the sandboxes of a fake hosted service to the gateways
// of stasis, as the service's network does: every connection on a
// sandbox's own gateway socket (local.GatewayServer,
// microvm.GatewayServer) is joined to the first of its targets, unix
// sockets tried in order, that answers. One target is one server; several
// are the nodes of a cluster behind one address, the way a load balancer
// sends a connection to a node that is up.
type Network struct {
	targets []string
	mu      sync.Mutex
	lns     map[string]net.Listener
	wg      sync.WaitGroup
}

// NewNetwork joins sandboxes to targets; Close ends it.
func NewNetwork(targets ...string) *Network {
	return &Network{targets: targets, lns: map[string]net.Listener{}}
}

// ServeSandbox serves sandbox id's socket until StopSandbox or Close.
func (n *Network) ServeSandbox(id string, ln net.Listener) {
	n.mu.Lock()
	if old := n.lns[id]; old != nil {
		_ = old.Close()
	}
	n.lns[id] = ln
	n.mu.Unlock()
	n.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go n.join(c)
		}
	})
}

// join copies between c and the first target that answers.
func (n *Network) join(c net.Conn) {
	defer c.Close()
	var up net.Conn
	for _, t := range n.targets {
		var err error
		if up, err = net.Dial("unix", t); err == nil {
			break
		}
	}
	if up == nil {
		return // no gateway is up: the relay sees the connection close
	}
	defer up.Close()
	go func() { _, _ = io.Copy(up, c); _ = up.(*net.UnixConn).CloseWrite() }()
	_, _ = io.Copy(c, up)
}

// StopSandbox closes sandbox id's socket.
func (n *Network) StopSandbox(id string) {
	n.mu.Lock()
	ln := n.lns[id]
	delete(n.lns, id)
	n.mu.Unlock()
	if ln != nil {
		_ = ln.Close()
	}
}

// Close closes every sandbox's socket and waits for their accept loops.
func (n *Network) Close() {
	n.mu.Lock()
	for id, ln := range n.lns {
		_ = ln.Close()
		delete(n.lns, id)
	}
	n.mu.Unlock()
	n.wg.Wait()
}
