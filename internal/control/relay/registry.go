package relay

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"stasis/internal/storage/atomicfile"
)

// Registry keeps the gateway's registrations of episodes (EpisodeState:
// token, attempt, sandbox): RegistryFiles, one file per episode in the
// gateway's state directory (the default), or RegistryPostgres, rows of a
// PostgreSQL database that the gateways of several nodes share, so that an
// episode restored on another node keeps its token and attempts there.
type Registry interface {
	// Get returns an episode's registration, or an error wrapping
	// ErrUnknownEpisode.
	Get(id string) (EpisodeState, error)
	// ByToken returns the registration whose token is tok, if any.
	ByToken(tok string) (EpisodeState, bool, error)
	// Put creates or replaces a registration, durably.
	Put(st EpisodeState) error
	// Remove forgets an episode; removing none is not an error.
	Remove(id string) error
}

// RegistryFiles is the Registry of files DIR/EPISODE.json.
type RegistryFiles string

var _ Registry = RegistryFiles("")

func (d RegistryFiles) path(id string) string { return filepath.Join(string(d), id+".json") }

// Get implements Registry.
func (d RegistryFiles) Get(id string) (EpisodeState, error) {
	if !episodeName.MatchString(id) {
		return EpisodeState{}, fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	b, err := os.ReadFile(d.path(id))
	if errors.Is(err, os.ErrNotExist) {
		return EpisodeState{}, fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	if err != nil {
		return EpisodeState{}, err
	}
	var st EpisodeState
	if err := json.Unmarshal(b, &st); err != nil || st.Episode != id {
		return EpisodeState{}, fmt.Errorf("episode %q: %s is damaged (%v)", id, d.path(id), err)
	}
	return st, nil
}

// ByToken implements Registry: it reads every file.
func (d RegistryFiles) ByToken(tok string) (EpisodeState, bool, error) {
	ents, err := os.ReadDir(string(d))
	if err != nil {
		return EpisodeState{}, false, err
	}
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".json"); ok {
			if st, err := d.Get(id); err == nil && st.Token == tok {
				return st, true, nil
			}
		}
	}
	return EpisodeState{}, false, nil
}

// Put implements Registry.
func (d RegistryFiles) Put(st EpisodeState) error {
	return atomicfile.WriteJSON(d.path(st.Episode), st, 0o600)
}

// Remove implements Registry.
func (d RegistryFiles) Remove(id string) error {
	if err := os.Remove(d.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// RegistryPostgres is the Registry of rows gateway_episodes(id, token,
// doc) in a PostgreSQL database.
type RegistryPostgres struct{ db *sql.DB }

var _ Registry = (*RegistryPostgres)(nil)

// OpenRegistryPostgres makes the registry's table in db (a database/sql
// handle of the pgx driver) when missing.
func OpenRegistryPostgres(ctx context.Context, db *sql.DB) (*RegistryPostgres, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("gateway registry: %w", err)
	}
	defer tx.Rollback()
	for _, stmt := range []string{
		`SELECT pg_advisory_xact_lock(5436) -- schema changes take turns`,
		`CREATE TABLE IF NOT EXISTS gateway_episodes (
			id    TEXT NOT NULL PRIMARY KEY,
			token TEXT NOT NULL UNIQUE,
			doc   TEXT NOT NULL
		)`,
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return nil, fmt.Errorf("gateway registry: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("gateway registry: %w", err)
	}
	return &RegistryPostgres{db: db}, nil
}

func (r *RegistryPostgres) one(q string, arg string) (EpisodeState, bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var doc string
	err := r.db.QueryRowContext(ctx, q, arg).Scan(&doc)
	if errors.Is(err, sql.ErrNoRows) {
		return EpisodeState{}, false, nil
	}
	if err != nil {
		return EpisodeState{}, false, fmt.Errorf("gateway registry: %w", err)
	}
	var st EpisodeState
	if err := json.Unmarshal([]byte(doc), &st); err != nil {
		return EpisodeState{}, false, fmt.Errorf("gateway registry: a damaged registration: %w", err)
	}
	return st, true, nil
}

// Get implements Registry.
func (r *RegistryPostgres) Get(id string) (EpisodeState, error) {
	st, ok, err := r.one(`SELECT doc FROM gateway_episodes WHERE id = $1`, id)
	if err == nil && !ok {
		err = fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	return st, err
}

// ByToken implements Registry.
func (r *RegistryPostgres) ByToken(tok string) (EpisodeState, bool, error) {
	return r.one(`SELECT doc FROM gateway_episodes WHERE token = $1`, tok)
}

// Put implements Registry.
func (r *RegistryPostgres) Put(st EpisodeState) error {
	doc, err := json.Marshal(st)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = r.db.ExecContext(ctx, `INSERT INTO gateway_episodes (id, token, doc) VALUES ($1, $2, $3)
		ON CONFLICT (id) DO UPDATE SET token = EXCLUDED.token, doc = EXCLUDED.doc`, st.Episode, st.Token, string(doc))
	if err != nil {
		return fmt.Errorf("gateway registry: %w", err)
	}
	return nil
}

// Remove implements Registry.
func (r *RegistryPostgres) Remove(id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := r.db.ExecContext(ctx, `DELETE FROM gateway_episodes WHERE id = $1`, id); err != nil {
		return fmt.Errorf("gateway registry: %w", err)
	}
	return nil
}
