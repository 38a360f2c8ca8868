package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
)

func TestWriteReplacesWholeAndLeavesNoTemp(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "a.json")
	if err := Write(p, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteJSON(p, map[string]int{"n": 1}, 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil || string(b) != "{\n  \"n\": 1\n}\n" {
		t.Fatalf("got %q %v", b, err)
	}
	fi, _ := os.Stat(p)
	if fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode %v", fi.Mode())
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("left behind: %v", ents)
	}
}

func TestReplaceIsAtomicToo(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "ack.json")
	if err := Write(p, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := ReplaceJSON(p, map[string]int{"n": 2}, 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil || string(b) != "{\n  \"n\": 2\n}\n" {
		t.Fatalf("got %q %v", b, err)
	}
	if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode %v", fi.Mode())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("left behind: %v", ents)
	}
	if err := Replace(filepath.Join(dir, "no", "x"), nil, 0o600); err == nil {
		t.Fatal("replace into a missing directory succeeded")
	}
}

func TestWriteIntoMissingDirFails(t *testing.T) {
	if err := Write(filepath.Join(t.TempDir(), "no", "x"), nil, 0o600); err == nil {
		t.Fatal("write into a missing directory succeeded")
	}
}

// BenchmarkWrite is the cost of one durable acknowledgement-sized write,
// beside os.WriteFile of the same bytes (no temporary file, no fsync) as the
// baseline; run in the directory the supervisor would use (TMPDIR).
func BenchmarkWrite(b *testing.B) {
	data := []byte(`{"seq":1,"op":"pause","mode":"hold","identity":{"pid":1,"start_time":1},"wall":1,"uptime":1,"confirmed":true}`)
	b.Run("atomic-durable", func(b *testing.B) {
		p := filepath.Join(b.TempDir(), "ack.json")
		for i := 0; i < b.N; i++ {
			if err := Write(p, data, 0o644); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("baseline-os.WriteFile", func(b *testing.B) {
		p := filepath.Join(b.TempDir(), "ack.json")
		for i := 0; i < b.N; i++ {
			if err := os.WriteFile(p, data, 0o644); err != nil {
				b.Fatal(err)
			}
		}
	})
}
