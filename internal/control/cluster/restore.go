package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/storage/store"
)

// A restore over the cluster places each episode of the checkpoint on a
// live node (the node that drove it, if it is live; otherwise the live
// nodes in turn), begins the restore with one share per node that gets
// episodes, and every such node forks and makes ready its own. Only when
// every node's forks are ready does any episode continue; a failure on
// any node, or a node whose lease runs out before it is ready, aborts the
// restore, and every node deletes its forks. An episode lands on another
// node only if that node can fork its snapshot: a hosted provider's
// sandboxes, or snapshots kept in a store every node reads.

// restoreKey is the waiters' key of restore id.
func restoreKey(id string) string { return "restore:" + id }

// restoreHandler takes the notifications of restores.
type restoreHandler struct{ m *Member }

func (h restoreHandler) HandleNotification(ctx context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	h.m.wake(restoreKey(n.Payload))
	h.m.considerRestore(ctx, n.Payload)
	return nil
}

func (h restoreHandler) HandleBacklog(ctx context.Context, _ string, _ *pgx.Conn) error {
	h.m.sweep(ctx)
	return nil
}

// considerRestore starts this node's share of restore id if it has one
// pending and it is not running yet.
func (m *Member) considerRestore(ctx context.Context, id string) {
	r, shares, err := m.o.Store.GetRestore(ctx, id)
	if err != nil || r.State != store.RestorePending {
		return
	}
	i := slices.IndexFunc(shares, func(s store.RestoreShare) bool { return s.Node == m.node.Name && s.Epoch == m.node.Epoch })
	if i < 0 || shares[i].State != store.SharePending {
		return
	}
	key := restoreKey(id)
	m.start(key, func(coord *coordinator.Coordinator) (coordinator.Result, error) {
		defer m.forget(key)
		return m.runRestoreShare(coord, r, shares[i].Episodes)
	})
}

// runRestoreShare forks and readies this node's episodes of restore r,
// waits for every other node's, and continues them, or undoes its forks.
func (m *Member) runRestoreShare(coord *coordinator.Coordinator, r store.Restore, episodes []string) (coordinator.Result, error) {
	ctx := context.Background()
	res, err := coord.RestoreWith(ctx, r.Checkpoint, coordinator.RestoreOptions{
		Episodes: episodes,
		Ref:      r.ID,
		Barrier: func(ctx context.Context, ready error) error {
			why := ""
			if ready != nil {
				why = ready.Error()
			}
			st, err := m.view.ReadyRestoreShare(ctx, r.ID, m.node.Name, why)
			if err != nil {
				return err
			}
			if ready != nil {
				return ready
			}
			if st == store.RestorePending {
				st = m.awaitRestore(m.bg, r.ID)
			}
			if st == store.RestoreGo {
				return nil
			}
			got, _, _ := m.o.Store.GetRestore(ctx, r.ID)
			return errdefs.Errorf(errdefs.ErrConflict, "restore %s of checkpoint %s was aborted (%s): this node's forks are deleted", r.ID, r.Checkpoint, got.Error)
		},
	})
	why := ""
	if err != nil {
		why = err.Error()
		m.log.Warn("this node's share of a restore failed", "restore", r.ID, "err", err)
	}
	if derr := m.view.DoneRestoreShare(ctx, r.ID, m.node.Name, why); derr != nil {
		m.log.Warn("record this node's share of a restore as done", "restore", r.ID, "err", derr)
	}
	return res, err
}

// Went says whether restore id went ahead (coordinator.Decisions): a
// restarted node asks it of a restore its last life was ready for when
// it died. A restore still pending is aborted if a node's lease ran out
// before it went (this node's last epoch's has, since Join waits for
// it); one still pending after that cannot be told yet.
func (m *Member) Went(ctx context.Context, id string) (bool, error) {
	r, _, err := m.o.Store.GetRestore(ctx, id)
	if err != nil {
		return false, err
	}
	if r.State == store.RestorePending {
		if _, err := m.o.Store.AbortLapsedRestore(ctx, id); err != nil {
			return false, err
		}
		if r, _, err = m.o.Store.GetRestore(ctx, id); err != nil {
			return false, err
		}
	}
	switch r.State {
	case store.RestoreGo:
		return true, nil
	case store.RestoreAborted:
		return false, nil
	}
	return false, errdefs.Errorf(errdefs.ErrUnavailable, "restore %s is still pending", id)
}

// Finished records this node's share of restore id as done, after a
// restarted node finished it (coordinator.Decisions).
func (m *Member) Finished(ctx context.Context, id, failure string) {
	if err := m.view.DoneRestoreShare(ctx, id, m.node.Name, failure); err != nil {
		m.log.Warn("record this node's share of a restore as done", "restore", id, "err", err)
	}
}

// awaitRestore waits until restore id goes or is aborted (aborting it once
// a node not yet ready has lost its lease), and returns its state.
func (m *Member) awaitRestore(ctx context.Context, id string) store.RestoreState {
	st := store.RestorePending
	m.poll(ctx, restoreKey(id), func() bool {
		if r, _, err := m.o.Store.GetRestore(ctx, id); err == nil && r.State != store.RestorePending {
			st = r.State
			return true
		}
		if aborted, err := m.o.Store.AbortLapsedRestore(ctx, id); err == nil && aborted {
			st = store.RestoreAborted
			return true
		}
		return false
	})
	return st
}

// awaitShares waits until every share of restore id is done, or the
// restore was aborted and every live node's share has ended.
func (m *Member) awaitShares(ctx context.Context, id string) (r store.Restore, shares []store.RestoreShare, err error) {
	over := m.poll(ctx, restoreKey(id), func() bool {
		if r, shares, err = m.o.Store.GetRestore(ctx, id); err != nil {
			return true
		}
		if r.State == store.RestorePending {
			_, _ = m.o.Store.AbortLapsedRestore(ctx, id) // seen at the next look
			return false
		}
		for _, sh := range shares {
			if sh.Live && sh.State != store.RestoreShareDone {
				return false
			}
		}
		return true
	})
	if err == nil && !over {
		err = ctx.Err()
	}
	return r, shares, err
}

// RestoreResult is a restore over the cluster: this node's figures and
// every node's share.
type RestoreResult struct {
	coordinator.Result
	Restore store.Restore        `json:"restore"`
	Shares  []store.RestoreShare `json:"shares"`
}

// Restore brings back the episodes of committed checkpoint id over the
// live nodes, all or nothing, and waits until every node is done: those
// named in episodes, or with none named every one but the retired ones
// (coordinator.RestoreOptions.Episodes).
func (m *Member) Restore(ctx context.Context, id string, episodes []string) (RestoreResult, error) {
	var out RestoreResult
	if err := m.Lost(); err != nil {
		return out, errdefs.Errorf(errdefs.ErrConflict, "%v", err)
	}
	c, recs, err := m.o.Store.Get(ctx, id)
	if err != nil {
		return out, err
	}
	if c.State != store.StateCommitted {
		return out, errdefs.Errorf(errdefs.ErrConflict, "checkpoint %s is %s: only a committed checkpoint restores", id, c.State)
	}
	all, err := m.o.Store.Nodes(ctx)
	if err != nil {
		return out, err
	}
	var live []store.Node
	liveName := map[string]bool{}
	for _, n := range all {
		if n.Live {
			live = append(live, n)
			liveName[n.Name] = true
		}
	}
	if len(live) == 0 {
		return out, errdefs.Errorf(errdefs.ErrConflict, "no live node to restore checkpoint %s on", id)
	}
	for _, n := range episodes {
		if !slices.ContainsFunc(recs, func(r store.Record) bool { return r.Episode == n }) {
			return out, errdefs.Errorf(errdefs.ErrNotFound, "episode %s is not in checkpoint %s", n, id)
		}
	}
	plan := map[string][]string{}
	turn := 0
	for _, r := range recs {
		row, rerr := m.o.Store.GetEpisode(ctx, r.Episode)
		switch {
		case episodes != nil && !slices.Contains(episodes, r.Episode):
			continue // not asked for
		case episodes == nil && rerr == nil && row.State == store.EpisodeRetired:
			out.Episodes = append(out.Episodes, coordinator.EpisodeFigures{Episode: r.Episode, Excluded: true, Resume: "none",
				Reason: "retired since the checkpoint: left out (name it in the restore to bring it back as its next attempt)"})
			continue
		}
		owner := ""
		if rerr == nil && liveName[row.Node] {
			owner = row.Node
		}
		if owner == "" { // its node is gone: the live nodes in turn
			owner = live[turn%len(live)].Name
			turn++
		}
		plan[owner] = append(plan[owner], r.Episode)
	}
	out.Checkpoint = id
	if len(plan) == 0 {
		// Nothing to bring back (no records, or every episode retired
		// since): no node has a share, so none would ever make the
		// restore go.
		return out, nil
	}
	rid := "restore-" + id + "-" + randomHex(4)
	if err := m.view.BeginRestore(ctx, rid, id, plan, live); err != nil {
		return out, err
	}
	m.considerRestore(ctx, rid)
	r, shares, err := m.awaitShares(ctx, rid)
	out.Restore, out.Shares = r, shares
	out.Checkpoint = id
	m.mu.Lock()
	own := m.running[restoreKey(rid)]
	m.mu.Unlock()
	if own != nil {
		select {
		case <-own.done:
			left := out.Episodes
			out.Result = own.res
			out.Episodes = append(out.Episodes, left...)
			out.Checkpoint = id
		case <-ctx.Done():
		}
	}
	if err != nil {
		return out, err
	}
	if r.State != store.RestoreGo {
		return out, errdefs.Errorf(errdefs.ErrConflict, "checkpoint %s: restore %s aborted, every fork deleted, nothing changed: %s", id, rid, r.Error)
	}
	var failed []error
	for _, sh := range shares {
		switch {
		case sh.Error != "":
			failed = append(failed, fmt.Errorf("node %s: %s", sh.Node, sh.Error))
		case sh.State != store.RestoreShareDone:
			failed = append(failed, fmt.Errorf("node %s stopped after the restore went, before it continued %s: it finishes them when it starts again as node %s", sh.Node, strings.Join(sh.Episodes, ", "), sh.Node))
		}
	}
	if len(failed) > 0 {
		return out, fmt.Errorf("checkpoint %s: restored, but not every episode could be continued: %w", id, errors.Join(failed...))
	}
	return out, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// CheckpointFrom takes checkpoint id over every live node of the cluster
// on st (the shared store, not a node's view of it; dsn is its URL) from
// outside the cluster, as `stasis ckpt create --store` does: it begins the
// checkpoint with one share per live node and waits until it is committed
// or failed, failing it once a node's lease runs out.
func CheckpointFrom(ctx context.Context, st *store.Postgres, dsn, id, stragglers string) ([]store.Share, error) {
	all, err := st.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	var live []store.Node
	var names []string
	for _, n := range all {
		if n.Live {
			live = append(live, n)
			names = append(names, n.Name)
		}
	}
	if len(live) == 0 {
		return nil, errdefs.Errorf(errdefs.ErrConflict, "no live node on this store: start stasis serve --node NAME --store … on each machine first")
	}
	mf, _ := json.Marshal(manifest{Nodes: names, Initiator: "", Stragglers: stragglers})
	// Listen before beginning, so that no notification is missed.
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, fmt.Errorf("listen for the checkpoint: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+store.CheckpointNotice); err != nil {
		return nil, fmt.Errorf("listen for the checkpoint: %w", err)
	}
	if err := st.BeginShared(ctx, id, mf, live); err != nil {
		return nil, err
	}
	for {
		c, _, err := st.Get(ctx, id)
		if err != nil {
			return nil, err
		}
		if c.State == store.StatePending {
			if _, err := st.FailLapsed(ctx, id); err != nil {
				return nil, err
			}
			wctx, cancel := context.WithTimeout(ctx, time.Second)
			_, werr := conn.WaitForNotification(wctx)
			cancel()
			if werr != nil && ctx.Err() != nil {
				return nil, ctx.Err()
			}
			continue
		}
		shares, err := st.Shares(ctx, id)
		if err != nil {
			return nil, err
		}
		if c.State == store.StateFailed {
			return shares, errdefs.Errorf(errdefs.ErrConflict, "checkpoint %s failed: %s", id, c.Error)
		}
		return shares, nil
	}
}
