package textwrap

import (
	"reflect"
	"testing"
)

func check(t *testing.T, text string, width int, want []string) {
	t.Helper()
	if got := Wrap(text, width); !reflect.DeepEqual(got, want) {
		t.Errorf("Wrap(%q, %d) = %q, want %q", text, width, got, want)
	}
}

func TestWrapASCII(t *testing.T) {
	check(t, "the quick brown fox jumps over the lazy dog", 10,
		[]string{"the quick", "brown fox", "jumps over", "the lazy", "dog"})
}

func TestWrapLongWordAndSpaces(t *testing.T) {
	check(t, "  a   supercalifragilistic  b ", 5,
		[]string{"a", "supercalifragilistic", "b"})
	check(t, "", 5, nil)
}

func TestFillIndent(t *testing.T) {
	got := Fill("one two three", 7, "> ")
	if want := "> one two\n> three"; got != want {
		t.Errorf("Fill = %q, want %q", got, want)
	}
}

func TestWrapAccentedWords(t *testing.T) {
	check(t, "café crème brûlée à emporter", 10,
		[]string{"café crème", "brûlée à", "emporter"})
}

func TestWrapCyrillic(t *testing.T) {
	check(t, "привет мир как дела", 10,
		[]string{"привет мир", "как дела"})
}
