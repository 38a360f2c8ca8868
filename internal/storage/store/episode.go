package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"stasis/errdefs"
	"stasis/sandbox"
	"time"
)

// EpisodeState is an episode's state in the record store.
type EpisodeState string

// The episode states.
const (
	EpisodeRunning EpisodeState = "running" // its harness runs (or is paused) in Sandbox
	EpisodeEnded   EpisodeState = "ended"   // its harness has ended; the sandbox is kept for verify
	EpisodeRetired EpisodeState = "retired" // its sandbox is deleted
	EpisodeLost    EpisodeState = "lost"    // its sandbox was gone when a server looked (a crash); a restore brings it back
)

// Episode is what the store keeps about one live or past episode: enough
// for any server on the same store to find its sandbox again and to go on
// driving it.
type Episode struct {
	ID       string `json:"id"`
	Task     string `json:"task"`
	Harness  string `json:"harness"`
	Provider string `json:"provider"`
	// Sandbox is the provider's sandbox id of the current attempt.
	Sandbox string `json:"sandbox"`
	Attempt int    `json:"attempt"`
	// PauseSeq is the last pause number sent to its supervisor; the next
	// pause uses PauseSeq+1.
	PauseSeq int64        `json:"pause_seq"`
	State    EpisodeState `json:"state"`
	// DeadlineS overrides the task's time budget for the harness (0: the
	// task's budget).
	DeadlineS float64 `json:"deadline_s,omitempty"`
	// Limits bound its sandboxes, every attempt's (zero fields: the
	// provider's defaults).
	Limits sandbox.Limits `json:"limits,omitzero"`
	// Image is the image reference its sandboxes run on: the episode's,
	// its task's or the server's default, as decided at its start (empty:
	// the provider's own root).
	Image string `json:"image,omitempty"`
	// Environment is what its harness and tests run in (host, venv:KEY,
	// image:DIGEST).
	Environment string `json:"environment,omitempty"`
	// Origin is the episode whose paths its sandboxes hold, for a copy
	// branched from another episode's checkpoint (empty: itself).
	Origin string `json:"origin,omitempty"`
	// Node is the node that drives it, of several sharing a store (""
	// for a store of one server): the node whose store last wrote it.
	Node string `json:"node,omitempty"`
	// Resume says how the last restore continued it: in_place, relaunch,
	// or empty.
	Resume  string    `json:"resume,omitempty"`
	Created time.Time `json:"created"`
	Updated time.Time `json:"updated"`
}

// PutEpisode creates or replaces an episode.
func (s *sqlStore) PutEpisode(ctx context.Context, e Episode) error {
	return s.PutEpisodes(ctx, []Episode{e})
}

// PutEpisodes creates or replaces episodes, all in one transaction.
func (s *sqlStore) PutEpisodes(ctx context.Context, es []Episode) error {
	docs, err := s.episodeDocs(es)
	if err != nil {
		return err
	}
	return s.write(ctx, func(tx *sql.Tx) error { return s.putEpisodesTx(ctx, tx, es, docs) })
}

// episodeDocs checks episodes, stamps their times and encodes them.
func (s *sqlStore) episodeDocs(es []Episode) ([]string, error) {
	docs := make([]string, len(es))
	now := s.now().UTC()
	for i := range es {
		e := &es[i]
		if e.ID == "" {
			return nil, errors.New("episode: the id is empty")
		}
		switch e.State {
		case EpisodeRunning, EpisodeEnded, EpisodeRetired, EpisodeLost:
		default:
			return nil, fmt.Errorf("episode %s: state %q is not running, ended, retired or lost", e.ID, e.State)
		}
		if e.Created.IsZero() {
			e.Created = now
		}
		e.Node = s.node()
		e.Updated = now
		doc, err := json.Marshal(e)
		if err != nil {
			return nil, err
		}
		docs[i] = string(doc)
	}
	return docs, nil
}

// putEpisodesTx writes encoded episodes inside tx.
func (s *sqlStore) putEpisodesTx(ctx context.Context, tx *sql.Tx, es []Episode, docs []string) error {
	for i, e := range es {
		res, err := tx.ExecContext(ctx, s.q(`UPDATE episodes SET state = ?, doc = ? WHERE id = ?`), e.State, docs[i], e.ID)
		if err != nil {
			return s.wrap(err)
		}
		if n, _ := res.RowsAffected(); n > 0 {
			continue
		}
		if _, err := tx.ExecContext(ctx, s.q(`INSERT INTO episodes (id, created_ns, state, doc) VALUES (?, ?, ?, ?)`),
			e.ID, e.Created.UnixNano(), e.State, docs[i]); err != nil {
			return s.wrap(err)
		}
	}
	return nil
}

// GetEpisode returns an episode (errdefs.ErrNotFound if there is none).
func (s *sqlStore) GetEpisode(ctx context.Context, id string) (Episode, error) {
	var doc string
	err := s.db.QueryRowContext(ctx, s.q(`SELECT doc FROM episodes WHERE id = ?`), id).Scan(&doc)
	if errors.Is(err, sql.ErrNoRows) {
		return Episode{}, fmt.Errorf("episode %q: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return Episode{}, s.wrap(err)
	}
	var e Episode
	if err := json.Unmarshal([]byte(doc), &e); err != nil {
		return Episode{}, fmt.Errorf("episode %q: unreadable: %w", id, err)
	}
	return e, nil
}

// ListEpisodes returns the episodes in a state ("" for all), oldest first.
func (s *sqlStore) ListEpisodes(ctx context.Context, state EpisodeState) ([]Episode, error) {
	q := `SELECT doc FROM episodes ORDER BY created_ns, id`
	var args []any
	if state != "" {
		q = `SELECT doc FROM episodes WHERE state = ? ORDER BY created_ns, id`
		args = append(args, string(state))
	}
	rows, err := s.db.QueryContext(ctx, s.q(q), args...)
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var out []Episode
	for rows.Next() {
		var doc string
		if err := rows.Scan(&doc); err != nil {
			return nil, s.wrap(err)
		}
		var e Episode
		if err := json.Unmarshal([]byte(doc), &e); err != nil {
			return nil, fmt.Errorf("an episode is unreadable: %w", err)
		}
		out = append(out, e)
	}
	return out, s.wrap(rows.Err())
}
