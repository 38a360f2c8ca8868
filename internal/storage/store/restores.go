package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"

	"stasis/errdefs"
)

// A restore over several nodes is all or nothing across them: the
// restore is begun with one share per node that brings episodes back;
// each node forks its episodes' snapshots and makes them ready, then says
// so (ReadyRestoreShare). Once every share is ready the restore goes
// (RestoreGo), and each node continues its episodes; if any share fails,
// or a node's lease runs out before the restore goes, the restore is
// aborted and every node deletes its forks.

// RestoreState is where a restore over several nodes is.
type RestoreState string

// The states of a restore.
const (
	RestorePending RestoreState = "pending" // forks being made ready
	RestoreGo      RestoreState = "go"      // every share ready: continue
	RestoreAborted RestoreState = "aborted" // a share failed: undo
)

// The states of a restore's share (ShareState's, and done).
const (
	RestoreShareReady ShareState = "ready"
	RestoreShareDone  ShareState = "done"
)

// RestoreNotice is the PostgreSQL notification channel on which a
// restore's id is sent when it is begun and whenever it changes.
const RestoreNotice = "stasis_restore"

// Restore is a restore over several nodes.
type Restore struct {
	ID         string       `json:"id"`
	Checkpoint string       `json:"checkpoint"`
	Node       string       `json:"node"` // who began it
	State      RestoreState `json:"state"`
	Error      string       `json:"error,omitempty"`
}

// RestoreShare is one node's part of a restore.
type RestoreShare struct {
	Node     string     `json:"node"`
	Epoch    int64      `json:"epoch"`
	Episodes []string   `json:"episodes"`
	State    ShareState `json:"state"`
	Error    string     `json:"error,omitempty"`
	Live     bool       `json:"live"`
}

// BeginRestore begins restore id of checkpoint over nodes, each bringing
// back the episodes plan names for it, and notifies RestoreNotice.
func (s *Postgres) BeginRestore(ctx context.Context, id, checkpoint string, plan map[string][]string, nodes []Node) error {
	if err := checkID(id); err != nil {
		return err
	}
	byName := map[string]Node{}
	for _, n := range nodes {
		byName[n.Name] = n
	}
	return s.tx(ctx, false, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO restores (id, checkpoint_id, node, state, error, created_ns) VALUES ($1, $2, $3, $4, '', `+dbNowNS+`)`,
			id, checkpoint, s.node(), string(RestorePending)); err != nil {
			return s.wrap(err)
		}
		names := make([]string, 0, len(plan))
		for name := range plan {
			names = append(names, name)
		}
		sort.Strings(names)
		for _, name := range names {
			n, ok := byName[name]
			if !ok {
				return errdefs.Errorf(errdefs.ErrInvalid, "restore %s: the plan names node %s, which is not among the nodes", id, name)
			}
			eps, _ := json.Marshal(plan[name])
			if _, err := tx.ExecContext(ctx, `INSERT INTO restore_shares (restore_id, node, epoch, episodes, state, error) VALUES ($1, $2, $3, $4, $5, '')`,
				id, n.Name, n.Epoch, string(eps), string(SharePending)); err != nil {
				return s.wrap(err)
			}
		}
		_, err := tx.ExecContext(ctx, `SELECT pg_notify($1, $2)`, RestoreNotice, id)
		return s.wrap(err)
	})
}

// restoreState reads restore id's state inside tx, locking its row.
func (s *Postgres) restoreState(ctx context.Context, tx *sql.Tx, id string) (RestoreState, error) {
	var st string
	err := tx.QueryRowContext(ctx, `SELECT state FROM restores WHERE id = $1 FOR UPDATE`, id).Scan(&st)
	if errors.Is(err, sql.ErrNoRows) {
		return "", fmt.Errorf("restore %q: %w", id, errdefs.ErrNotFound)
	}
	return RestoreState(st), s.wrap(err)
}

// ReadyRestoreShare says how node's forks of restore id went: ready
// (failure "") or failed. The last share ready makes the restore go; a
// failed one aborts it. It returns the restore's state after (a share of
// a restore no longer pending changes nothing but says so).
func (s *Postgres) ReadyRestoreShare(ctx context.Context, id, node, failure string) (RestoreState, error) {
	var out RestoreState
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		st, err := s.restoreState(ctx, tx, id)
		if err != nil {
			return err
		}
		out = st
		if st != RestorePending {
			return nil
		}
		next := RestoreShareReady
		if failure != "" {
			next = ShareFailed
		}
		res, err := tx.ExecContext(ctx, `UPDATE restore_shares SET state = $3, error = $4 WHERE restore_id = $1 AND node = $2 AND state = $5`,
			id, node, string(next), failure, string(SharePending))
		if err != nil {
			return s.wrap(err)
		}
		if k, _ := res.RowsAffected(); k == 0 {
			return fmt.Errorf("restore %q has no pending share for node %s: %w", id, node, errdefs.ErrConflict)
		}
		switch {
		case failure != "":
			out = RestoreAborted
			if _, err := tx.ExecContext(ctx, `UPDATE restores SET state = $2, error = $3 WHERE id = $1`, id, string(out), fmt.Sprintf("node %s: %s", node, failure)); err != nil {
				return s.wrap(err)
			}
		default:
			var pending int
			if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM restore_shares WHERE restore_id = $1 AND state <> $2`, id, string(RestoreShareReady)).Scan(&pending); err != nil {
				return s.wrap(err)
			}
			if pending == 0 {
				// It goes only if every node that is to continue its
				// episodes still holds its lease; a node that lapsed
				// after it was ready could not.
				lapsed, err := s.lapsedShares(ctx, tx, "restore_shares", "restore_id", id, RestoreShareReady)
				if err != nil {
					return err
				}
				out = RestoreGo
				why := ""
				if len(lapsed) > 0 {
					out, why = RestoreAborted, lapsedWhy(lapsed)
				}
				if _, err := tx.ExecContext(ctx, `UPDATE restores SET state = $2, error = $3 WHERE id = $1`, id, string(out), why); err != nil {
					return s.wrap(err)
				}
			}
		}
		_, err = tx.ExecContext(ctx, `SELECT pg_notify($1, $2)`, RestoreNotice, id)
		return s.wrap(err)
	})
	return out, err
}

// DoneRestoreShare records that node has continued its episodes of
// restore id (failure: why some could not be), and notifies.
func (s *Postgres) DoneRestoreShare(ctx context.Context, id, node, failure string) error {
	return s.tx(ctx, false, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `UPDATE restore_shares SET state = $3, error = $4 WHERE restore_id = $1 AND node = $2`,
			id, node, string(RestoreShareDone), failure); err != nil {
			return s.wrap(err)
		}
		_, err := tx.ExecContext(ctx, `SELECT pg_notify($1, $2)`, RestoreNotice, id)
		return s.wrap(err)
	})
}

// GetRestore returns restore id and its shares, each with whether its
// node's epoch holds a live lease.
func (s *Postgres) GetRestore(ctx context.Context, id string) (Restore, []RestoreShare, error) {
	var r Restore
	err := s.db.QueryRowContext(ctx, `SELECT id, checkpoint_id, node, state, error FROM restores WHERE id = $1`, id).
		Scan(&r.ID, &r.Checkpoint, &r.Node, &r.State, &r.Error)
	if errors.Is(err, sql.ErrNoRows) {
		return r, nil, fmt.Errorf("restore %q: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return r, nil, s.wrap(err)
	}
	rows, err := s.db.QueryContext(ctx, `SELECT s.node, s.epoch, s.episodes, s.state, s.error,
		EXISTS (SELECT 1 FROM nodes n WHERE n.name = s.node AND n.epoch = s.epoch AND n.lease_until_ns > `+dbNowNS+`)
		FROM restore_shares s WHERE s.restore_id = $1 ORDER BY s.node`, id)
	if err != nil {
		return r, nil, s.wrap(err)
	}
	defer rows.Close()
	var shares []RestoreShare
	for rows.Next() {
		var sh RestoreShare
		var eps, state string
		if err := rows.Scan(&sh.Node, &sh.Epoch, &eps, &state, &sh.Error, &sh.Live); err != nil {
			return r, nil, s.wrap(err)
		}
		sh.State = ShareState(state)
		if err := json.Unmarshal([]byte(eps), &sh.Episodes); err != nil {
			return r, nil, fmt.Errorf("restore %q: node %s's episodes: %w", id, sh.Node, err)
		}
		shares = append(shares, sh)
	}
	return r, shares, s.wrap(rows.Err())
}

// PendingRestores lists the restores not yet gone or aborted.
func (s *Postgres) PendingRestores(ctx context.Context) ([]string, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id FROM restores WHERE state = $1 ORDER BY created_ns`, string(RestorePending))
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, s.wrap(err)
		}
		out = append(out, id)
	}
	return out, s.wrap(rows.Err())
}

// lapsedWhy is a restore's error when the leases of nodes ran out before
// it went.
func lapsedWhy(nodes []string) string {
	return fmt.Sprintf("the lease of node %s ran out before the restore went", strings.Join(nodes, ", "))
}

// AbortLapsedRestore aborts pending restore id if a node of one of its
// shares (not yet ready, or ready and waiting) no longer holds a live
// lease: the restore can then not go everywhere. It reports whether it
// did. Once a restore has gone, a node that dies is left to finish its
// share when it starts again (coordinator.Options.Decisions).
func (s *Postgres) AbortLapsedRestore(ctx context.Context, id string) (bool, error) {
	aborted := false
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		aborted = false
		st, err := s.restoreState(ctx, tx, id)
		if err != nil || st != RestorePending {
			return err
		}
		lapsed, err := s.lapsedShares(ctx, tx, "restore_shares", "restore_id", id, SharePending, RestoreShareReady)
		if err != nil || len(lapsed) == 0 {
			return err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE restores SET state = $2, error = $3 WHERE id = $1`, id, string(RestoreAborted), lapsedWhy(lapsed)); err != nil {
			return s.wrap(err)
		}
		aborted = true
		_, err = tx.ExecContext(ctx, `SELECT pg_notify($1, $2)`, RestoreNotice, id)
		return s.wrap(err)
	})
	return aborted, err
}
