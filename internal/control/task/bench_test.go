package task_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"stasis/internal/control/task"
	"stasis/internal/control/task/pyenv"
	"stasis/internal/control/task/tasktest"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// BenchmarkVerify times one verify (restore the tests, run them, judge)
// of a built-in Python task (the baseline) and of a SWE-bench instance in
// the environment stasis built for it, each in a local sandbox made once.
//
//	go test -run '^$' -bench BenchmarkVerify -benchtime 10x ./task
func BenchmarkVerify(b *testing.B) {
	tasktest.NeedPythonEnv(b)
	ctx := context.Background()
	ts, err := task.Builtin()
	if err != nil {
		b.Fatal(err)
	}
	builtin, err := task.Lookup(ts, "py-money-negative-cents")
	if err != nil {
		b.Fatal(err)
	}
	jsonl, repos := tasktest.SWEBenchRepo(b)
	envs := b.TempDir()
	sw, _, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{Repos: repos, Envs: envs})
	if err != nil || len(sw) != 1 {
		b.Fatal(err)
	}
	if _, err := sw[0].Environment(ctx); err != nil {
		b.Fatal(err)
	}
	p, err := local.New(local.Options{Home: b.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, ReadOnlyBinds: map[string]string{envs: pyenv.SandboxRoot}})
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		tk   *task.Task
	}{{"builtin-unittest", builtin}, {"swebench-venv-pytest", sw[0]}} {
		b.Run(c.name, func(b *testing.B) {
			tree := b.TempDir()
			if err := c.tk.Materialize(tree); err != nil {
				b.Fatal(err)
			}
			info, err := p.Create(ctx, sandbox.Spec{Root: tree, Env: c.tk.EnvMap(), Expiry: time.Now().Add(time.Hour)})
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = p.Delete(ctx, info.ID) }()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				v, err := task.RunTests(ctx, p, info.ID, c.tk)
				if err != nil || v.Status != task.StatusUnresolved {
					b.Fatalf("%+v %v", v, err)
				}
			}
		})
	}
}

// BenchmarkEnvBuild times an environment's first build and a cached
// Ensure, against a bare venv made with Debian's python3 (the baseline).
//
//	go test -run '^$' -bench BenchmarkEnvBuild -benchtime 5x ./task
func BenchmarkEnvBuild(b *testing.B) {
	tasktest.NeedPythonEnv(b)
	ctx := context.Background()
	jsonl, repos := tasktest.SWEBenchRepo(b)
	sw, _, err := task.LoadSWEBench(jsonl, task.SWEBenchOptions{Repos: repos})
	if err != nil || len(sw) != 1 {
		b.Fatal(err)
	}
	req := pyenv.Request{Repo: "acme/calc", Clone: sw[0].Source.Path, Commit: sw[0].SWEBench.BaseCommit}
	b.Run("bare-venv", func(b *testing.B) {
		dir := b.TempDir()
		for i := 0; i < b.N; i++ {
			if out, err := exec.Command("/usr/bin/python3", "-m", "venv", "--without-pip", filepath.Join(dir, fmt.Sprint(i))).CombinedOutput(); err != nil {
				b.Fatalf("%v: %s", err, out)
			}
		}
	})
	b.Run("first-build", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if _, err := pyenv.Ensure(ctx, filepath.Join(b.TempDir(), "envs"), req, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("cached", func(b *testing.B) {
		cache := b.TempDir()
		if _, err := pyenv.Ensure(ctx, cache, req, nil); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			e, err := pyenv.Ensure(ctx, cache, req, nil)
			if err != nil || !e.Cached {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkGoVerify times one verify of a built-in Go task: "empty", each
// from an empty build cache (what every Go verify would cost without a
// seed), against "seeded", each from a copy of the task's seed (made once,
// before the timer). Both in one local sandbox made once.
//
//	go test -run '^$' -bench BenchmarkGoVerify -benchtime 3x ./task
func BenchmarkGoVerify(b *testing.B) {
	ctx := context.Background()
	ts, err := task.Builtin()
	if err != nil {
		b.Fatal(err)
	}
	tk, err := task.Lookup(ts, "go-lru-get-recency")
	if err != nil {
		b.Fatal(err)
	}
	p, err := local.New(local.Options{Home: b.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		b.Fatal(err)
	}
	st, err := store.OpenSQLite(filepath.Join(b.TempDir(), "store.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	tree := b.TempDir()
	if err := tk.Materialize(tree); err != nil {
		b.Fatal(err)
	}
	info, err := p.Create(ctx, sandbox.Spec{Root: tree, Env: tk.EnvMap(), Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = p.Delete(ctx, info.ID) }()
	seeds := b.TempDir()
	if (&task.Verifier{Store: st, Provider: p, SeedDir: seeds}).Seed(ctx, tk) == "" {
		b.Fatal("no seed")
	}
	n := 0
	for _, c := range []struct{ name, seeds string }{{"empty", ""}, {"seeded", seeds}} {
		b.Run(c.name, func(b *testing.B) {
			v := &task.Verifier{Store: st, Provider: p, SeedDir: c.seeds}
			for i := 0; i < b.N; i++ {
				n++
				vd, _, err := v.Verify(ctx, fmt.Sprintf("bench-%d", n), 0, info.ID, tk, nil)
				if err != nil || vd.Status != task.StatusUnresolved {
					b.Fatalf("%+v %v", vd, err)
				}
			}
		})
	}
}
