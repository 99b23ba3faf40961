// The console works without this script; it adds "select all".
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", function () {
    document.querySelectorAll('#selection input[name="id"]').forEach(function (box) {
      box.checked = all.checked;
    });
  });
});
