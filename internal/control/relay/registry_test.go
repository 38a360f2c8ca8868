package relay

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"

	"stasis/internal/pgtest"
)

// Both registries keep, find by token, replace and forget registrations
// alike.
func TestRegistries(t *testing.T) {
	for name, open := range map[string]func(t *testing.T) Registry{
		"files": func(t *testing.T) Registry { return RegistryFiles(t.TempDir()) },
		"postgres": func(t *testing.T) Registry {
			db, err := sql.Open("pgx", pgtest.DSN(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			r, err := OpenRegistryPostgres(context.Background(), db)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := OpenRegistryPostgres(context.Background(), db); err != nil {
				t.Fatalf("a second open: %v", err)
			}
			return r
		},
	} {
		t.Run(name, func(t *testing.T) {
			r := open(t)
			if _, err := r.Get("ep"); !errors.Is(err, ErrUnknownEpisode) {
				t.Fatalf("Get of none: %v", err)
			}
			st := EpisodeState{Episode: "ep", Token: "tok-1", Created: time.Unix(1, 0).UTC()}
			if err := r.Put(st); err != nil {
				t.Fatal(err)
			}
			st.Attempt, st.Sandbox = 2, "sb-1"
			if err := r.Put(st); err != nil {
				t.Fatal(err)
			}
			if got, err := r.Get("ep"); err != nil || got != st {
				t.Fatalf("Get: %+v %v", got, err)
			}
			if got, ok, err := r.ByToken("tok-1"); err != nil || !ok || got != st {
				t.Fatalf("ByToken: %+v %v %v", got, ok, err)
			}
			if _, ok, err := r.ByToken("tok-2"); err != nil || ok {
				t.Fatalf("ByToken of an unknown token: %v %v", ok, err)
			}
			if err := r.Remove("ep"); err != nil {
				t.Fatal(err)
			}
			if err := r.Remove("ep"); err != nil {
				t.Fatalf("a second Remove: %v", err)
			}
			if _, err := r.Get("ep"); !errors.Is(err, ErrUnknownEpisode) {
				t.Fatalf("Get after Remove: %v", err)
			}
		})
	}
}
