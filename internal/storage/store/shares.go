package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"stasis/errdefs"
)

// A checkpoint over several nodes (a store several servers share) is begun
// with one share per node: each node pauses, snapshots and records its own
// episodes, then finishes its share, prepared with the number of records
// it put, or failed with the reason. The node that finishes the last share
// commits the checkpoint in the same transaction, expecting every share's
// records; a failed share fails the checkpoint at once. A node that dies
// mid-prepare leaves its share pending: once its lease has run out, any
// node fails the checkpoint (FailLapsed). Either way the previous committed
// checkpoint is untouched.

// ShareState is where one node's share of a checkpoint is.
type ShareState string

// The states of a share.
const (
	SharePending  ShareState = "pending"
	SharePrepared ShareState = "prepared"
	ShareFailed   ShareState = "failed"
)

// Share is one node's part of a checkpoint over several nodes.
type Share struct {
	Node    string     `json:"node"`
	Epoch   int64      `json:"epoch"`
	State   ShareState `json:"state"`
	Records int        `json:"records"` // the records it put, once prepared
	Error   string     `json:"error,omitempty"`
	// Live: the node's epoch still held a live lease when asked.
	Live bool `json:"live"`
}

// CheckpointNotice is the PostgreSQL notification channel on which a
// checkpoint's id is sent when it is begun over several nodes and whenever
// one of its shares finishes (or it fails), so that nodes act and waiters
// wake without polling.
const CheckpointNotice = "stasis_checkpoint"

// BeginShared begins checkpoint id over nodes, each with a pending share,
// in one transaction that also notifies CheckpointNotice.
func (s *Postgres) BeginShared(ctx context.Context, id string, manifest json.RawMessage, nodes []Node) error {
	if err := checkID(id); err != nil {
		return err
	}
	if len(manifest) > 0 && !json.Valid(manifest) {
		return fmt.Errorf("begin checkpoint %q: its manifest is not valid JSON", id)
	}
	if len(nodes) == 0 {
		return errdefs.Errorf(errdefs.ErrInvalid, "begin checkpoint %q: no node to take it", id)
	}
	return s.tx(ctx, false, func(tx *sql.Tx) error {
		if err := s.beginTx(ctx, tx, id, manifest); err != nil {
			return err
		}
		for _, n := range nodes {
			if _, err := tx.ExecContext(ctx, `INSERT INTO checkpoint_shares (checkpoint_id, node, epoch, state, records, error) VALUES ($1, $2, $3, $4, 0, '')`,
				id, n.Name, n.Epoch, string(SharePending)); err != nil {
				return s.wrap(err)
			}
		}
		return s.notify(ctx, tx, id)
	})
}

func (s *Postgres) notify(ctx context.Context, tx *sql.Tx, id string) error {
	_, err := tx.ExecContext(ctx, `SELECT pg_notify($1, $2)`, CheckpointNotice, id)
	return s.wrap(err)
}

// FinishShare records node's share of checkpoint id: prepared with the
// records it put (failure ""), or failed with failure. When it was the
// last share pending and every share is prepared, the checkpoint is
// committed in the same transaction, expecting the sum of their records
// (Commit's checks); a failed share fails the checkpoint. It returns the
// checkpoint's state after, and notifies CheckpointNotice. A share already
// finished, or of a checkpoint no longer pending, is refused with
// errdefs.ErrConflict and changes nothing.
func (s *Postgres) FinishShare(ctx context.Context, id, node string, records int, failure string) (State, error) {
	if records < 0 {
		return "", errdefs.Errorf(errdefs.ErrInvalid, "share of checkpoint %q: %d records", id, records)
	}
	var out State
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		out = ""
		st, err := s.state(ctx, tx, id)
		if err != nil {
			return err
		}
		if st != StatePending {
			return fmt.Errorf("share of node %s in checkpoint %q: %w: the checkpoint is %s already", node, id, errdefs.ErrConflict, st)
		}
		var share string
		err = tx.QueryRowContext(ctx, `SELECT state FROM checkpoint_shares WHERE checkpoint_id = $1 AND node = $2 FOR UPDATE`, id, node).Scan(&share)
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("checkpoint %q has no share for node %s: %w", id, node, errdefs.ErrNotFound)
		}
		if err != nil {
			return s.wrap(err)
		}
		if ShareState(share) != SharePending {
			return fmt.Errorf("share of node %s in checkpoint %q: %w: it is %s already", node, id, errdefs.ErrConflict, share)
		}
		next := SharePrepared
		if failure != "" {
			next = ShareFailed
		}
		if _, err := tx.ExecContext(ctx, `UPDATE checkpoint_shares SET state = $3, records = $4, error = $5 WHERE checkpoint_id = $1 AND node = $2`,
			id, node, string(next), records, failure); err != nil {
			return s.wrap(err)
		}
		out = StatePending
		switch {
		case failure != "":
			if _, err := tx.ExecContext(ctx, `UPDATE checkpoints SET state = $2, error = $3 WHERE id = $1`,
				id, string(StateFailed), fmt.Sprintf("node %s failed its share: %s; the previous committed checkpoint is unchanged", node, failure)); err != nil {
				return s.wrap(err)
			}
			out = StateFailed
		default:
			var pending, total int
			if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FILTER (WHERE state <> $2), COALESCE(SUM(records), 0) FROM checkpoint_shares WHERE checkpoint_id = $1`,
				id, string(SharePrepared)).Scan(&pending, &total); err != nil {
				return s.wrap(err)
			}
			if pending == 0 {
				reason, err := s.commitLocked(ctx, tx, id, total)
				if err != nil {
					return err
				}
				out = StateCommitted
				if reason != "" {
					out = StateFailed
				}
			}
		}
		return s.notify(ctx, tx, id)
	})
	return out, err
}

// Shares returns checkpoint id's shares, by node, each with whether its
// node's epoch holds a live lease now.
func (s *Postgres) Shares(ctx context.Context, id string) ([]Share, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT s.node, s.epoch, s.state, s.records, s.error,
		EXISTS (SELECT 1 FROM nodes n WHERE n.name = s.node AND n.epoch = s.epoch AND n.lease_until_ns > `+dbNowNS+`)
		FROM checkpoint_shares s WHERE s.checkpoint_id = $1 ORDER BY s.node`, id)
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var out []Share
	for rows.Next() {
		var sh Share
		var state string
		if err := rows.Scan(&sh.Node, &sh.Epoch, &state, &sh.Records, &sh.Error, &sh.Live); err != nil {
			return nil, s.wrap(err)
		}
		sh.State = ShareState(state)
		out = append(out, sh)
	}
	return out, s.wrap(rows.Err())
}

// lapsedShares lists, in tx, the nodes whose share (a row of table, whose
// column col names the operation id) is in one of states while their
// epoch no longer holds a live lease. A lease is judged as of the
// transaction's start (txNowNS), not the clock now: tx reads the nodes'
// rows as they were when its snapshot was taken, and it may have waited
// for a lock since, while the nodes renewed their leases.
func (s *Postgres) lapsedShares(ctx context.Context, tx *sql.Tx, table, col, id string, states ...ShareState) ([]string, error) {
	args := []any{id}
	in := make([]string, len(states))
	for i, st := range states {
		args = append(args, string(st))
		in[i] = fmt.Sprintf("$%d", i+2)
	}
	rows, err := tx.QueryContext(ctx, `SELECT s.node FROM `+table+` s WHERE s.`+col+` = $1 AND s.state IN (`+strings.Join(in, ", ")+`)
		AND NOT EXISTS (SELECT 1 FROM nodes n WHERE n.name = s.node AND n.epoch = s.epoch AND n.lease_until_ns > `+txNowNS+`) ORDER BY s.node`,
		args...)
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var lapsed []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, s.wrap(err)
		}
		lapsed = append(lapsed, n)
	}
	return lapsed, s.wrap(rows.Err())
}

// FailLapsed fails pending checkpoint id if a node whose share is still
// pending no longer holds a live lease (it died, or was cut off, while it
// prepared): the checkpoint cannot be completed. It reports whether it
// failed it; a checkpoint no longer pending is left as it is.
func (s *Postgres) FailLapsed(ctx context.Context, id string) (bool, error) {
	failed := false
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		failed = false
		st, err := s.state(ctx, tx, id)
		if err != nil || st != StatePending {
			return err
		}
		lapsed, err := s.lapsedShares(ctx, tx, "checkpoint_shares", "checkpoint_id", id, SharePending)
		if err != nil || len(lapsed) == 0 {
			return err
		}
		reason := fmt.Sprintf("the lease of node %s ran out while it prepared its share; the previous committed checkpoint is unchanged", strings.Join(lapsed, ", "))
		for _, n := range lapsed {
			if _, err := tx.ExecContext(ctx, `UPDATE checkpoint_shares SET state = $3, error = $4 WHERE checkpoint_id = $1 AND node = $2`,
				id, n, string(ShareFailed), "its lease ran out"); err != nil {
				return s.wrap(err)
			}
		}
		if _, err := tx.ExecContext(ctx, `UPDATE checkpoints SET state = $2, error = $3 WHERE id = $1`, id, string(StateFailed), reason); err != nil {
			return s.wrap(err)
		}
		failed = true
		return s.notify(ctx, tx, id)
	})
	return failed, err
}
