package cluster

// Halt stops the node's heartbeat and listener without ending its lease,
// as if its process had died: the lease runs out on its own. Shares under
// way go on (a test releases them).
func (m *Member) Halt() { m.stop() }
