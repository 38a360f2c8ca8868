// Package cluster owns what makes several stasis serve nodes on one shared
// state (a PostgreSQL store and ledgers, snapshots every node can fork) act
// as one: each node's membership, a lease it renews as its heartbeat; and
// checkpoints over every live node's episodes. A checkpoint is begun by
// any node with one share per live node; each node is told by a PostgreSQL
// notification (LISTEN/NOTIFY), prepares its own episodes (pause,
// snapshot, record, continue) and finishes its share; whichever node
// finishes the last share commits the checkpoint in the same transaction.
// A node that dies mid-prepare fails the checkpoint once its lease runs
// out; the previous committed checkpoint stays, and the other nodes'
// episodes go on.
package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/storage/store"
)

// DefaultLease is how long a node's lease lasts without a renewal.
const DefaultLease = 10 * time.Second

// Options configure a node.
type Options struct {
	// Store is the shared store (not a node's view of it).
	Store *store.Postgres
	// DSN is its URL, for the connection that listens for notifications.
	DSN string
	// Name is the node's name; Addr is its API as others reach it.
	Name, Addr string
	// Lease is the node's lease (default DefaultLease); it is renewed
	// every third of it.
	Lease  time.Duration
	Logger *slog.Logger
	// OnLeaseLost is called once if the node loses its lease (its
	// renewals failed until it ran out, or another epoch took its name).
	OnLeaseLost func(error)
}

// Member is this process's membership of the cluster.
type Member struct {
	o     Options
	node  store.Node
	view  *store.Postgres // the store as this node writes it
	log   *slog.Logger
	bg    context.Context // ended by Close
	stop  context.CancelFunc
	wg    sync.WaitGroup
	coord *coordinator.Coordinator

	mu      sync.Mutex
	lost    error
	running map[string]*share          // checkpoints whose share runs here now
	waiters map[string][]chan struct{} // woken at each notification of a checkpoint
}

// Join registers the node (a new epoch of its name), and starts renewing
// its lease and listening for checkpoints. Shares are taken once Serve
// names the coordinator.
func Join(ctx context.Context, o Options) (*Member, error) {
	if o.Lease == 0 {
		o.Lease = DefaultLease
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	// A server restarted right after it died finds its name's last
	// lease still running: it waits for it to run out (a lease, and a
	// little), and fails if it does not (another server renews it).
	deadline := time.Now().Add(o.Lease + o.Lease/2)
	n, err := o.Store.Join(ctx, o.Name, o.Addr, o.Lease)
	for errors.Is(err, errdefs.ErrConflict) && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond): // poll interval, bounded by the deadline
		}
		n, err = o.Store.Join(ctx, o.Name, o.Addr, o.Lease)
	}
	if err != nil {
		return nil, err
	}
	m := &Member{o: o, node: n, view: o.Store.AsNode(n), log: o.Logger.With("node", n.Name, "epoch", n.Epoch),
		running: map[string]*share{}, waiters: map[string][]chan struct{}{}}
	m.bg, m.stop = context.WithCancel(context.Background())
	m.wg.Add(1)
	go m.heartbeat(m.bg)
	return m, nil
}

// Node is the node's membership: its name and epoch.
func (m *Member) Node() store.Node { return m.node }

// Store is the shared store as this node writes it: every write needs its
// lease (store.Postgres.AsNode).
func (m *Member) Store() *store.Postgres { return m.view }

// NodeLive says whether node name holds a live lease now.
func (m *Member) NodeLive(ctx context.Context, name string) (bool, error) {
	ns, err := m.o.Store.Nodes(ctx)
	if err != nil {
		return false, err
	}
	for _, n := range ns {
		if n.Name == name {
			return n.Live, nil
		}
	}
	return false, nil
}

// Lost says why the node lost its lease, or nil while it holds it.
func (m *Member) Lost() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lost
}

// heartbeat renews the lease every third of it until ctx ends. A renewal
// that fails is tried again at the next tick; once the lease is known to
// be lost (or has run out by this process's clock), the node is lost.
func (m *Member) heartbeat(ctx context.Context) {
	defer m.wg.Done()
	tick := time.NewTicker(m.o.Lease / 3)
	defer tick.Stop()
	until := time.Now().Add(m.o.Lease)
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		// A renewal slowed by a busy database is given until the lease
		// would run out, not cut off at the next tick: landing late, it
		// still extends the lease from when it ran.
		rctx, cancel := context.WithDeadline(ctx, until)
		t0 := time.Now()
		_, err := m.o.Store.Renew(rctx, m.node, m.o.Lease)
		cancel()
		switch {
		case err == nil:
			until = t0.Add(m.o.Lease)
			continue
		case ctx.Err() != nil:
			return
		case errors.Is(err, store.ErrLeaseLost) || time.Now().After(until):
			m.loseLease(err)
			return
		default:
			m.log.Warn("lease renewal failed; trying again", "err", err, "lease_until", until)
		}
	}
}

func (m *Member) loseLease(err error) {
	m.mu.Lock()
	first := m.lost == nil
	if first {
		m.lost = fmt.Errorf("node %s (epoch %d) lost its lease: %w", m.node.Name, m.node.Epoch, err)
	}
	lost := m.lost
	m.mu.Unlock()
	if first {
		m.log.Error("lease lost: this node writes nothing more to the shared state", "err", err)
		if m.o.OnLeaseLost != nil {
			m.o.OnLeaseLost(lost)
		}
	}
}

// Serve takes this node's shares of checkpoints with coord, from now on:
// it listens for the notifications of checkpoints begun (and takes those
// begun before it listened).
func (m *Member) Serve(coord *coordinator.Coordinator) {
	m.mu.Lock()
	m.coord = coord
	m.mu.Unlock()
	bg := m.bg
	l := &pgxlisten.Listener{
		Connect:        func(ctx context.Context) (*pgx.Conn, error) { return pgx.Connect(ctx, m.o.DSN) },
		LogError:       func(_ context.Context, err error) { m.log.Warn("checkpoint notifications", "err", err) },
		ReconnectDelay: time.Second,
	}
	l.Handle(store.CheckpointNotice, handler{m})
	l.Handle(store.RestoreNotice, restoreHandler{m})
	m.wg.Add(2)
	go func() {
		defer m.wg.Done()
		_ = l.Listen(bg)
	}()
	// Notifications can be missed (a reconnect): look now and then too.
	go func() {
		defer m.wg.Done()
		tick := time.NewTicker(m.o.Lease / 2)
		defer tick.Stop()
		for {
			select {
			case <-bg.Done():
				return
			case <-tick.C:
				m.sweep(bg)
			}
		}
	}()
}

// handler takes the notifications of checkpoints.
type handler struct{ m *Member }

func (h handler) HandleNotification(ctx context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	h.m.wake(n.Payload)
	h.m.consider(ctx, n.Payload)
	return nil
}

// HandleBacklog takes the shares of checkpoints begun while nothing
// listened.
func (h handler) HandleBacklog(ctx context.Context, _ string, _ *pgx.Conn) error {
	h.m.sweep(ctx)
	return nil
}

// sweep takes every pending share of this node, and fails the pending
// checkpoints whose nodes' leases ran out.
func (m *Member) sweep(ctx context.Context) {
	cs, err := m.o.Store.List(ctx, store.ListOptions{State: store.StatePending})
	if err != nil {
		m.log.Warn("look for pending checkpoints", "err", err)
		return
	}
	for _, c := range cs {
		if failed, err := m.o.Store.FailLapsed(ctx, c.ID); err == nil && failed {
			m.log.Warn("checkpoint failed: a node's lease ran out while it prepared", "checkpoint", c.ID)
			m.wake(c.ID)
			continue
		}
		m.consider(ctx, c.ID)
	}
	rs, err := m.o.Store.PendingRestores(ctx)
	if err != nil {
		m.log.Warn("look for pending restores", "err", err)
		return
	}
	for _, id := range rs {
		if aborted, err := m.o.Store.AbortLapsedRestore(ctx, id); err == nil && aborted {
			m.log.Warn("restore aborted: a node's lease ran out before it went", "restore", id)
			m.wake(restoreKey(id))
			continue
		}
		m.considerRestore(ctx, id)
	}
}

// consider starts this node's share of checkpoint id if it has one
// pending and it is not running yet.
func (m *Member) consider(ctx context.Context, id string) {
	shares, err := m.o.Store.Shares(ctx, id)
	if err != nil {
		m.log.Warn("read a checkpoint's shares", "checkpoint", id, "err", err)
		return
	}
	i := slices.IndexFunc(shares, func(s store.Share) bool { return s.Node == m.node.Name && s.Epoch == m.node.Epoch })
	if i < 0 || shares[i].State != store.SharePending {
		return
	}
	m.start(id, func(coord *coordinator.Coordinator) (coordinator.Result, error) { return m.runShare(coord, id) })
}

// start runs share key (a checkpoint's id, or a restore's key) with the
// coordinator, in the background, unless it runs already, no coordinator
// serves yet, or the node has lost its lease.
func (m *Member) start(key string, run func(*coordinator.Coordinator) (coordinator.Result, error)) {
	m.mu.Lock()
	coord := m.coord
	if coord == nil || m.running[key] != nil || m.lost != nil {
		m.mu.Unlock()
		return
	}
	sh := &share{done: make(chan struct{})}
	m.running[key] = sh
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		defer close(sh.done)
		sh.res, sh.err = run(coord)
	}()
}

// share is this node's share of a checkpoint, under way or done.
type share struct {
	done chan struct{} // closed when its prepare has returned
	res  coordinator.Result
	err  error
}

// runShare prepares this node's episodes for checkpoint id and finishes
// its share; if the checkpoint fails afterwards (another node's share),
// it deletes the snapshots it made for it.
func (m *Member) runShare(coord *coordinator.Coordinator, id string) (coordinator.Result, error) {
	// The prepare runs to its end even if the node is closing (Close
	// waits): its episodes must not stay paused.
	ctx := context.Background()
	var last store.State
	var mf manifest
	if c, _, err := m.o.Store.Get(ctx, id); err == nil {
		_ = json.Unmarshal(c.Manifest, &mf)
	}
	res, err := coord.PrepareWith(ctx, id, coordinator.PrepareOptions{
		Stragglers: mf.Stragglers,
		Finish: func(ctx context.Context, records int, failure error) (store.State, error) {
			why := ""
			if failure != nil {
				why = failure.Error()
			}
			st, err := m.view.FinishShare(ctx, id, m.node.Name, records, why)
			last = st
			return st, err
		},
	})
	if err != nil {
		m.log.Warn("this node's share of a checkpoint failed", "checkpoint", id, "err", err)
	} else {
		m.log.Info("this node's share of a checkpoint is in", "checkpoint", id, "episodes", len(res.Episodes), "state", last)
	}
	if err == nil && last == store.StatePending {
		// Wait, in the background, for the other nodes: if the
		// checkpoint fails, this node's snapshots are garbage.
		var snaps []string
		for _, f := range res.Episodes {
			if f.Snapshot != "" {
				snaps = append(snaps, f.Snapshot)
			}
		}
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			if st := m.await(m.bg, id); st == store.StateFailed {
				coord.DeleteSnapshots(ctx, id, snaps)
			}
			m.forget(id)
		}()
	} else {
		m.forget(id)
	}
	return res, err
}

// forget drops a finished share, a while after it finished (a late
// notification of its checkpoint must not start it again).
func (m *Member) forget(id string) {
	time.AfterFunc(time.Minute, func() {
		m.mu.Lock()
		delete(m.running, id)
		m.mu.Unlock()
	})
}

// wake wakes every waiter of checkpoint id.
func (m *Member) wake(id string) {
	m.mu.Lock()
	ws := m.waiters[id]
	delete(m.waiters, id)
	m.mu.Unlock()
	for _, w := range ws {
		close(w)
	}
}

// next returns a channel closed at the next notification of id.
func (m *Member) next(id string) chan struct{} {
	ch := make(chan struct{})
	m.mu.Lock()
	m.waiters[id] = append(m.waiters[id], ch)
	m.mu.Unlock()
	return ch
}

// await waits until checkpoint id is committed or failed, failing it once
// a pending share's node has lost its lease, and returns its state.
func (m *Member) await(ctx context.Context, id string) store.State {
	st := store.StatePending
	m.poll(ctx, id, func() bool {
		if c, _, err := m.o.Store.Get(ctx, id); err == nil && c.State != store.StatePending {
			st = c.State
			return true
		}
		if failed, err := m.o.Store.FailLapsed(ctx, id); err == nil && failed {
			st = store.StateFailed
			return true
		}
		return false
	})
	return st
}

// poll calls done now, then at each notification of key (and every
// quarter of a lease, should one be missed), until it reports true or ctx
// ends; it says whether done did.
func (m *Member) poll(ctx context.Context, key string, done func() bool) bool {
	for {
		woken := m.next(key)
		if done() {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-woken:
		case <-time.After(m.o.Lease / 4):
		}
	}
}

// Result is a checkpoint over the cluster: this node's figures and every
// node's share.
type Result struct {
	coordinator.Result
	State  store.State   `json:"state"`
	Error  string        `json:"error,omitempty"`
	Shares []store.Share `json:"shares"`
}

// manifest is what a checkpoint over the cluster says of itself.
type manifest struct {
	Nodes      []string `json:"nodes"`
	Initiator  string   `json:"initiator"`
	Stragglers string   `json:"stragglers,omitempty"`
}

// Checkpoint takes checkpoint id of every live node's episodes: it begins
// it with a share per live node, takes this node's share, and waits until
// the checkpoint is committed or failed. stragglers is every node's policy
// for this checkpoint ("": each node's own).
func (m *Member) Checkpoint(ctx context.Context, id, stragglers string) (Result, error) {
	if err := m.Lost(); err != nil {
		return Result{}, errdefs.Errorf(errdefs.ErrConflict, "%v", err)
	}
	all, err := m.o.Store.Nodes(ctx)
	if err != nil {
		return Result{}, err
	}
	var live []store.Node
	var names []string
	for _, n := range all {
		if n.Live {
			live = append(live, n)
			names = append(names, n.Name)
		}
	}
	mf, _ := json.Marshal(manifest{Nodes: names, Initiator: m.node.Name, Stragglers: stragglers})
	if err := m.view.BeginShared(ctx, id, mf, live); err != nil {
		return Result{}, err
	}
	m.consider(ctx, id)
	st := m.await(ctx, id)
	res := Result{State: st}
	m.mu.Lock()
	own := m.running[id]
	m.mu.Unlock()
	if own != nil {
		// This node's share: its episodes continued, its figures.
		select {
		case <-own.done:
			res.Result = own.res
		case <-ctx.Done():
		}
	}
	res.Checkpoint = id
	c, _, err := m.o.Store.Get(ctx, id)
	if err == nil {
		res.Error = c.Error
	}
	if res.Shares, err = m.o.Store.Shares(ctx, id); err != nil {
		return res, err
	}
	switch st {
	case store.StateCommitted:
		return res, nil
	case store.StateFailed:
		return res, errdefs.Errorf(errdefs.ErrConflict, "checkpoint %s failed: %s", id, res.Error)
	}
	return res, ctx.Err()
}

// Close stops renewing the lease and listening, waits for the shares under
// way, and ends the lease (unless it was lost).
func (m *Member) Close() error {
	m.stop()
	m.wg.Wait()
	if m.Lost() != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return m.o.Store.Leave(ctx, m.node)
}
