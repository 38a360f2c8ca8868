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

func TestWriteIntoMissingDirFails(t *testing.T) {
	if err := Write(filepath.Join(t.TempDir(), "no", "x"), nil, 0o600); err == nil {
		t.Fatal("write into a missing directory succeeded")
	}
}
